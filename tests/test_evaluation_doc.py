"""docs/evaluation.md against what it describes: its "how do I" front links into headings that
exist (as GitHub names their anchors), and its hand-written lists of metric names are the
registry's (rebm/eval/registry.py) and the paper tables' (experiments/paper/*.yaml)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import yaml

from rebm.eval.registry import metric_classes, metric_names
from tests.helpers import REPO

DOC = REPO / "docs" / "evaluation.md"
FRONT_LINES = 40
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def headings(text: str) -> List[str]:
    """The Markdown headings of `text`, without the lines of fenced code blocks (a `# comment`
    in a bash block is no heading)."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.append(line.lstrip("#").strip())
    return found


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its text lower-cased (links by their text, code
    without backticks), every character but letters, digits, `_`, `-` and spaces dropped,
    spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> Set[str]:
    """Every heading anchor of a Markdown file; GitHub numbers repeats: x, x-1, x-2, ..."""
    seen: Dict[str, int] = {}
    found = set()
    for heading in headings(path.read_text()):
        anchor = github_anchor(heading)
        found.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
        seen[anchor] = seen.get(anchor, 0) + 1
    return found


def broken_links(path: Path, lines: List[str]) -> List[str]:
    """The links of `lines` (of the Markdown file `path`) to a heading or file that does not
    exist; web links are not followed."""
    broken = []
    for target in LINK.findall("\n".join(lines)):
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists() or (anchor and anchor not in anchors(linked)):
            broken.append(target)
    return broken


def test_the_anchors_are_githubs():
    """Spot checks of the rule on this doc's own kinds of heading (GitHub's anchors of them)."""
    assert github_anchor("Paper tables (`python -m rebm.eval.table`)") == \
        "paper-tables-python--m-rebmevaltable"
    assert github_anchor("Check before spending GPU hours (`--check`)") == \
        "check-before-spending-gpu-hours---check"
    assert github_anchor("1. The Inception weights (offline)") == "1-the-inception-weights-offline"
    assert github_anchor("The paper's checkpoints") == "the-papers-checkpoints"


def test_the_front_links_to_headings_that_exist():
    """The first 40 lines answer "how do I" (evaluate a checkpoint, write a table, run the
    paper's tables, go without the Inception weights) with links into the reference below,
    and every one of them lands on a heading."""
    front = DOC.read_text().splitlines()[:FRONT_LINES]
    targets = LINK.findall("\n".join(front))
    assert broken_links(DOC, front) == []
    for topic in ("#evaluating-a-checkpoint", "#the-table-file",
                  "#paper-tables-python--m-rebmevaltable",
                  "#without-the-inception-weights-the-stand-in"):
        assert topic in targets, f"the front of docs/evaluation.md does not link to {topic}"


def test_every_link_of_the_doc_lands():
    """Not only the front: a renamed heading breaks the links to it anywhere in the doc."""
    assert broken_links(DOC, DOC.read_text().splitlines()) == []


def metric_table() -> List[Tuple[str, ...]]:
    """The rows of the table under "## The metrics": (name, pass, summary line, reference)."""
    text = DOC.read_text()
    section = text[text.index("\n## The metrics\n"):]
    section = section[:section.index("\n### ")]
    return [tuple(cell.strip() for cell in line.strip("|").split("|"))
            for line in section.splitlines() if line.startswith("| `")]


def test_the_metric_table_is_the_registry():
    """Every registered metric, in registry order, with the pass that feeds it (`source`) and
    its labels in the summary line (`summary_values`); a new metric fails here until its row
    is written."""
    rows = metric_table()
    assert [row[0].strip("`") for row in rows] == metric_names(), \
        "docs/evaluation.md, 'The metrics': one row per name of METRICS, in its order"
    for (_, source, summary, _), metric in zip(rows, metric_classes(metric_names()), strict=True):
        labels = [label for _, label, _ in metric.summary_values()]
        assert source == metric.source, metric.name
        if labels:
            assert summary == ", ".join(labels), metric.name
        else:  # a metric that writes files only
            assert summary.startswith("—"), metric.name


def test_the_flags_add_registered_metrics():
    """The flag table of "Evaluating a checkpoint" names metrics that exist."""
    text = DOC.read_text()
    flags = text[text.index("| flag | adds (metric names) |"):]
    flags = flags[:flags.index("\n\n")]
    named = set(re.findall(r"\(`(\w+)`\)", flags))
    assert named and named <= set(metric_names()), named - set(metric_names())


def test_the_paper_tables_metrics_are_the_table_files():
    """The table of "Paper tables" lists each file's `metrics:` as the file has them."""
    text = DOC.read_text()
    table = text[text.index("| table | file | metrics |"):]
    listed = {}
    for line in table[:table.index("\n\n")].splitlines()[2:]:
        _, path, metrics = (cell.strip() for cell in line.strip("|").split("|"))
        listed[path.strip("`")] = re.findall(r"`(\w+)`", metrics)
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "experiments/paper").glob("*.yaml"))
    assert sorted(listed) == files
    for path, metrics in listed.items():
        assert metrics == yaml.safe_load((REPO / path).read_text())["metrics"], path
