"""`python -m rebm.eval.table TABLE --checkpoints DIR --check`: before spending GPU hours, what
the rows need and this machine lacks. It loads each row's config as the run would (a bad key is
one line naming the row), collects the row's checkpoint and every file of its metrics
(`Metric.files`: statistics, seeds, reference batches, feature-network weights, dataset roots)
where the run reads it (a relative path: under --checkpoints, then the current directory,
rebm/eval/table/paths.py), and what the metrics report this machine lacks (`Metric.problems`).
It prints each missing file once, as the absolute path it goes to, with the folders looked in,
the rows and metrics that need it, grouped by where it comes from (`paths.DATA_SOURCES`);
`--verbose` first lists every row's files, present or missing. No process group, nothing
computed; the exit code is non-zero when something is missing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Set, Tuple

from rebm.eval.registry import metric_classes
from rebm.eval.table.paths import (
    config_value,
    data_source,
    find_data_path,
    looked_in,
    missing_target,
    rule_line,
)
from rebm.eval.table.spec import own_metrics, own_rows, row_sections

EXIT_MISSING = 1  # --check found a missing file
Needs = Dict[Tuple[str, str], List[str]]  # (what, path) -> the metrics that read it
RowId = Tuple[str, str]  # (table stem, row name)
NAMED_ROWS = 5  # the last line names at most this many rows lacking something, else counts


@dataclass
class Wanted:
    """One missing file or folder, however many rows need it."""
    source: str
    looked: Tuple[str, ...]  # folders a relative path was looked up in; () for the others
    checkpoint: bool
    metrics: List[str] = field(default_factory=list)
    rows: List[RowId] = field(default_factory=list)


@dataclass
class Findings:
    """What every selected row of every table needs, each file and problem once."""
    tables: Dict[str, List[str]] = field(default_factory=dict)  # stem -> its selected rows
    present: Set[str] = field(default_factory=set)
    missing: Dict[str, Wanted] = field(default_factory=dict)  # absolute path -> what needs it
    problems: Dict[str, Wanted] = field(default_factory=dict)  # problem -> metrics and rows
    lacking: List[RowId] = field(default_factory=list)


def row_needs(spec, row, sections, checkpoint_root: str
              ) -> Tuple[Needs, Dict[str, List[str]], Set[str]]:
    """(needs, {problem: metrics}, mentions) of one row: its checkpoint and every file of its
    metrics (`Metric.files`), what its metrics report this machine lacks (`Metric.problems`),
    and the missing files' paths and templates (a problem quoting one repeats the list)."""
    needs: Needs = {("checkpoint", os.path.join(checkpoint_root, row.checkpoint)): []}
    problems: Dict[str, List[str]] = {}
    mentions: Set[str] = set()
    for cls in metric_classes(spec.metrics):
        evaluation = sections[row.name][cls.name]
        for label, path in cls.files(evaluation).items():
            if path is None:
                continue
            needs.setdefault((label, str(path)), []).append(cls.name)
            if not os.path.exists(str(path)):
                mentions.add(str(path))
                value = config_value(evaluation, label)  # a per-class template: '...class{label}.npz'
                mentions.update([value] if isinstance(value, str) and "{" in value else [])
        for problem in cls.problems(evaluation):
            problems.setdefault(problem, []).append(cls.name)
    return needs, problems, mentions


def print_row(row, needs: Needs, problems: Dict[str, List[str]], checkpoint_root: str) -> None:
    """--verbose: the row's every file, present or missing, and its problems."""
    print(f"row {row.name}:")
    for (label, path), metrics in needs.items():
        state = "present" if os.path.exists(path) else "MISSING"
        kind = " (folder)" if os.path.isdir(path) else ""
        if state == "MISSING" and label != "checkpoint":
            _, folders = find_data_path(path, checkpoint_root)
            kind = f" ({looked_in(folders)})" if folders else ""
        used = f"  [{', '.join(metrics)}]" if metrics else ""
        print(f"  {state:8} {label}: {path}{kind}{used}")
    for problem, metrics in problems.items():
        print(f"  problem  [{', '.join(metrics)}] {problem}")


def note(found: Dict[str, Wanted], key: str, wanted: Wanted, metrics: List[str],
         row: RowId) -> None:
    """Add one row's need of `key` (a file or a problem) to `found`, once per key."""
    entry = found.setdefault(key, wanted)
    entry.metrics += [m for m in metrics if m not in entry.metrics]
    entry.rows += [row] if row not in entry.rows else []


def check_table(spec, checkpoint_root: str, verbose: bool, found: Findings) -> None:
    """Collect what every row of `spec` needs into `found`; print its rows under --verbose."""
    sections = row_sections(spec, checkpoint_root)
    print(f"{spec.path} ({spec.stem}: {spec.title}): {len(spec.rows)} row(s); metrics "
          f"{', '.join(spec.metrics)}")
    found.tables[spec.stem] = [row.name for row in spec.rows]
    for row in spec.rows:
        needs, problems, mentions = row_needs(spec, row, sections, checkpoint_root)
        # what a real run would refuse, but those that repeat a missing file
        problems = {p: m for p, m in problems.items() if not any(f in p for f in mentions)}
        if verbose:
            print_row(row, needs, problems, checkpoint_root)
        row_id = (spec.stem, row.name)
        lacks = bool(problems)
        for (label, path), metrics in needs.items():
            if os.path.exists(path):
                found.present.add(os.path.abspath(path))
                continue
            lacks = True
            checkpoint = label == "checkpoint"
            source = data_source(row.checkpoint if checkpoint else path)
            target, folders = ((os.path.abspath(path), ()) if checkpoint
                               else missing_target(path, checkpoint_root))
            note(found.missing, target, Wanted(source, folders, checkpoint), metrics, row_id)
        for problem, metrics in problems.items():
            note(found.problems, problem, Wanted("", (), False), metrics, row_id)
        found.lacking += [row_id] if lacks else []


def rows_text(rows: List[RowId], found: Findings) -> str:
    """'row a', 'every row (40)', 'all 7 rows of t' or names: the rows that need something."""
    if len(rows) > 1 and len(rows) == sum(len(r) for r in found.tables.values()):
        return f"every row ({len(rows)})"
    parts = []
    for stem, names in found.tables.items():
        mine = [name for (table, name) in rows if table == stem]
        if len(mine) > 1 and len(mine) == len(names):
            parts.append(f"all {len(names)} rows of {stem}")
        elif mine:
            parts.append(f"row{'s' if len(mine) > 1 else ''} {', '.join(mine)}")
    return "; ".join(parts)


def print_missing(found: Findings) -> None:
    """Each missing file once, under where it comes from: checkpoints first, then data."""
    if not found.missing:
        return
    print(f"missing: {len(found.missing)} file(s), each once with [the metrics and rows that "
          "need it], under where it comes from:")
    sources: Dict[str, List[str]] = {}
    for path, wanted in found.missing.items():
        sources.setdefault(wanted.source, []).append(path)
    for source, paths in sources.items():
        print(f"from {source}")
        for path in sorted(paths, key=lambda p: not found.missing[p].checkpoint):
            wanted = found.missing[path]
            where = f" ({looked_in(wanted.looked)})" if wanted.looked else ""
            used = f"{', '.join(wanted.metrics)} of " if wanted.metrics else ""
            print(f"  {path}{where}  [{used}{rows_text(wanted.rows, found)}]")
    for problem, wanted in found.problems.items():
        print(f"problem [{', '.join(wanted.metrics)}] {problem}  "
              f"[{rows_text(wanted.rows, found)}]")


def last_line(found: Findings) -> str:
    """The counts, and the names of the rows lacking something when they are few."""
    listed = len(found.present) + len(found.missing)
    if not found.lacking:
        return f"check: all {listed} files present; nothing was computed"
    total = sum(len(r) for r in found.tables.values())
    if len(found.lacking) <= NAMED_ROWS:
        rows = f"in row(s) {', '.join(name for _, name in found.lacking)}"
    else:
        rows = f"in {len(found.lacking)} of {total} rows (named above)"
    return (f"check: {len(found.missing)} of {listed} files missing, {len(found.problems)} "
            f"other problem(s), {rows}; nothing was computed")


def check(specs, args) -> int:
    """--check: 0 when every file of every selected row is present and no metric reports a
    problem (what the real run would refuse), else EXIT_MISSING."""
    if not os.path.isdir(args.checkpoint_root):
        print(f"note: --checkpoints folder '{args.checkpoint_root}' does not exist")
    print(rule_line(args.checkpoint_root))
    found = Findings()
    for spec in specs:
        check_table(spec.select(own_rows(spec, args.rows), own_metrics(spec, args.metrics)),
                    args.checkpoint_root, getattr(args, "verbose", False), found)
    print_missing(found)
    print(last_line(found))
    return EXIT_MISSING if found.lacking else 0
