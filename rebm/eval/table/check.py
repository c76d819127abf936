"""`python -m rebm.eval.table TABLE --checkpoints DIR --check`: before spending GPU hours, what
every row needs, present or missing. It loads each row's config as the run would (a bad key is
one line naming the row), lists the row's checkpoint and every file of its metrics
(`Metric.files`: statistics, seeds, reference batches, feature-network weights, dataset roots)
where the run reads it (a relative path: under --checkpoints, then the current directory,
rebm/eval/table/paths.py; a missing one names the folders looked in), and what the metrics
report this machine lacks (`Metric.problems`). No process group, nothing computed; the exit
code is non-zero when something is missing.
"""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

from rebm.eval.registry import metric_classes
from rebm.eval.table.paths import find_data_path, looked_in, rule_line
from rebm.eval.table.spec import own_metrics, own_rows, row_configs

EXIT_MISSING = 1  # --check found a missing file
Needs = Dict[Tuple[str, str], List[str]]  # (what, path) -> the metrics that read it


def row_needs(spec, row, configs, checkpoints: str) -> Tuple[Needs, Dict[str, List[str]]]:
    """(needs, {problem: metrics}) of one row: its checkpoint and every file of its metrics
    (`Metric.files`), and what its metrics report this machine lacks (`Metric.problems`)."""
    needs: Needs = {("checkpoint", os.path.join(checkpoints, row.checkpoint)): []}
    problems: Dict[str, List[str]] = {}
    for cls in metric_classes(spec.metrics):
        cfg = configs[row.name][cls.name]
        for label, path in cls.files(cfg).items():
            if path is not None:
                needs.setdefault((label, str(path)), []).append(cls.name)
        for problem in cls.problems(cfg):
            problems.setdefault(problem, []).append(cls.name)
    return needs, problems


def check_table(spec, checkpoints: str) -> Tuple[int, int, int, List[str]]:
    """Print what every row of `spec` needs; (files listed, files missing, other problems,
    rows lacking something)."""
    configs = row_configs(spec, checkpoints)
    print(f"{spec.path} ({spec.stem}: {spec.title}): {len(spec.rows)} row(s); metrics "
          f"{', '.join(spec.metrics)}")
    listed, missing, other, rows = 0, 0, 0, []
    for row in spec.rows:
        needs, problems = row_needs(spec, row, configs, checkpoints)
        absent = [path for (_, path) in needs if not os.path.exists(path)]
        print(f"row {row.name}:")
        for (label, path), metrics in needs.items():
            state = "present" if os.path.exists(path) else "MISSING"
            kind = " (folder)" if os.path.isdir(path) else ""
            if state == "MISSING" and label != "checkpoint":
                _, folders = find_data_path(path, checkpoints)
                kind = f" ({looked_in(folders)})" if folders else ""
            used = f"  [{', '.join(metrics)}]" if metrics else ""
            print(f"  {state:8} {label}: {path}{kind}{used}")
        # what a real run would refuse, but those that repeat a missing file
        problems = {p: m for p, m in problems.items() if not any(f in p for f in absent)}
        for problem, metrics in problems.items():
            print(f"  problem  [{', '.join(metrics)}] {problem}")
        listed, missing, other = listed + len(needs), missing + len(absent), other + len(problems)
        rows += [row.name] if absent or problems else []
    return listed, missing, other, rows


def check(specs, args) -> int:
    """--check: 0 when every file of every selected row is present and no metric reports a
    problem (what the real run would refuse), else EXIT_MISSING."""
    if not os.path.isdir(args.checkpoints):
        print(f"note: --checkpoints folder '{args.checkpoints}' does not exist")
    print(rule_line(args.checkpoints))
    listed = missing = other = 0
    rows: List[str] = []
    for spec in specs:
        counts = check_table(spec.select(own_rows(spec, args.rows), own_metrics(spec, args.metrics)),
                             args.checkpoints)
        listed, missing, other = listed + counts[0], missing + counts[1], other + counts[2]
        rows += counts[3]
    if rows:
        print(f"check: {missing} of {listed} files missing, {other} other problem(s), in row(s) "
              f"{', '.join(rows)}; nothing was computed")
        return EXIT_MISSING
    print(f"check: all {listed} files present; nothing was computed")
    return 0
