"""Generate docs/configs.md from the config dataclasses, so the reference cannot drift:
`python -m rebm.config.docs > docs/configs.md` (a test regenerates and compares)."""

from __future__ import annotations

import inspect
import re
from dataclasses import fields, is_dataclass
from typing import List

from rebm.config import (
    IGNORED_FIELDS,
    AttackConfig,
    DataConfig,
    ImageLogConfig,
    ModelConfig,
    TrainConfig,
)
from rebm.config.evaluation import EvalConfig

SECTIONS = [
    ("", TrainConfig, "Top level"),
    ("data.", DataConfig, "`data.*`"),
    ("model.", ModelConfig, "`model.*`"),
    ("attack.", AttackConfig, "`attack.*` and `indist_attack_clf.*` (same fields)"),
    ("image_log.", ImageLogConfig, "`image_log.*`"),
    ("eval.", EvalConfig, "`eval.*` (rebm/config/evaluation.py)"),
]
FIELD_LINE = re.compile(r"^\s+(\w+):\s*[^=]+?(?:=\s*(.*?))?\s*(?:#\s*(.*))?$")


def _comments(cls: type) -> dict:
    """The trailing `# comment` of each field line (legacy bases included)."""
    out = {}
    for klass in reversed([k for k in cls.__mro__ if k is not object]):
        for line in inspect.getsource(klass).splitlines():
            match = FIELD_LINE.match(line)
            if match and not line.strip().startswith(("def ", "class ", "@", '"""')):
                out[match.group(1)] = (match.group(3) or "").strip()
    return out


def _default(instance, name: str) -> str:
    value = getattr(instance, name)
    if is_dataclass(value):
        return "(section)"
    return repr(value).replace("|", "\\|")


def render() -> str:
    lines: List[str] = [
        "# Configuration reference",
        "",
        "Generated from `rebm/config/schema.py` and `rebm/config/legacy.py` by "
        "`python -m rebm.config.docs`; do not edit by hand.",
        "",
        "One YAML file is one experiment; override any field on the command line with "
        "`key=value` or `section.key=value`. Field names are those of the original DAT configs. "
        "Fields marked *ignored* are accepted so that old files load, and reported once at "
        "start-up.",
        "",
    ]
    for prefix, cls, title in SECTIONS:
        comments = _comments(cls)
        instance = cls()
        lines += [f"## {title}", "", "| field | default | meaning |", "|---|---|---|"]
        # the fields rebm reads first, then the accepted-but-ignored legacy ones
        for f in sorted(fields(cls), key=lambda f: (prefix + f.name) in IGNORED_FIELDS):
            if is_dataclass(getattr(instance, f.name)):
                continue
            key = prefix + f.name
            note = comments.get(f.name, "")
            if key in IGNORED_FIELDS:
                note = "*ignored* — " + note
            lines.append(f"| `{key}` | `{_default(instance, f.name)}` | {note} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m rebm.config.docs",
        description="Print the configuration reference (Markdown) generated from the config "
                    "dataclasses; the repository keeps it as docs/configs.md.")
    parser.parse_args(argv)
    print(render(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
