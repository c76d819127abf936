"""Generate docs/configs.md from the config dataclasses, so the reference cannot drift:
`python -m rebm.config.docs > docs/configs.md` (a test regenerates and compares)."""

from __future__ import annotations

import inspect
import re
from dataclasses import is_dataclass
from typing import List

from rebm.config import ALIASES, IGNORED_FIELDS, TrainConfig
from rebm.config.layout import file_leaves
from rebm.config.original_defaults import render_audit

# (the file's prefix, title): the keys of each block of a config file (rebm/config/layout.py)
SECTIONS = [
    ("", "Top level"),
    ("data.", "`data.*`"),
    ("model.", "`model.*`"),
    ("attack.", "`attack.*` and `indist_attack_clf.*` (same fields)"),
    ("image_log.", "`image_log.*`"),
    ("eval.", "`eval.*` (rebm/config/evaluation.py)"),
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


def _legacy_note(f) -> str:
    """What the original did with a legacy field, and rebm's decision (rebm/compat/config_fields.py)."""
    accepted = f.metadata.get("accepted")
    if accepted is None:
        return "*ignored* — in the original DAT code: " + f.metadata["why"]
    values = ", ".join("null" if a is None else f"`{a}`" for a in accepted)
    return (f"*other values refused* (accepted without effect: {values}) — in the original DAT "
            f"code: {f.metadata['why']}")


def _default(instance, name: str) -> str:
    value = getattr(instance, name)
    if is_dataclass(value):
        return "(section)"
    return repr(value).replace("|", "\\|")


def render() -> str:
    lines: List[str] = [
        "# Configuration reference",
        "",
        "Generated from `rebm/config/schema.py`, `sections.py` and `rebm/compat/config_fields.py` by "
        "`python -m rebm.config.docs`; do not edit by hand.",
        "",
        "One YAML file is one experiment; override any field on the command line with "
        "`key=value` or `section.key=value`. Field names are those of the original DAT configs. "
        "Fields marked *ignored* had no effect in the original either: they are accepted so "
        "that old files load, and a run names them in one line at start-up. Fields marked "
        "*other values refused* had an effect that rebm does not offer: their accepted values "
        "do nothing, any other value stops the run at load with one line.",
        "",
    ]
    leaves = list(file_leaves(TrainConfig()))
    for prefix, title in SECTIONS:
        lines += [f"## {title}", "", "| field | default | meaning |", "|---|---|---|"]
        block = [leaf for leaf in leaves if leaf[0].count(".") == (1 if prefix else 0)
                 and leaf[0].startswith(prefix)]
        # the fields rebm reads first, then the accepted-but-ignored legacy ones
        for key, _, owner, f in sorted(block, key=lambda leaf: leaf[0] in IGNORED_FIELDS):
            note = _comments(type(owner)).get(f.name, "")
            if key in IGNORED_FIELDS:
                note = _legacy_note(f)
            lines.append(f"| `{key}` | `{_default(owner, f.name)}` | {note} |")
        lines.append("")
    lines += render_audit()
    lines += ["## Aliases", "",
              "Keys of the original configs that rebm reads under its own name; they are renamed "
              "before the file is merged, and a file that sets both spellings to different values "
              "is refused.", "", "| original key | rebm field | meaning |", "|---|---|---|"]
    lines += [f"| `{a.old}` | `{a.new}` | {a.meaning} |" for a in ALIASES]
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
