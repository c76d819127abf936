"""One command per paper table: evaluate every row of a table YAML, then write table.md/.csv.

    python -m rebm.eval.table experiments/paper/cifar10.yaml --checkpoints DIR \\
        [--rows NAME|GROUP ...] [--metrics NAME ...] [--out DIR] [--force] [--check [--verbose]]
    torchrun --nproc_per_node=N -m rebm.eval.table experiments/paper/cifar10.yaml --checkpoints DIR
    python -m rebm.eval.table ORIGINAL/model_configs[/FILE.yaml] --checkpoints ORIGINAL \\
        [--protocol TABLE]

The rows run one after another in one process group (the table format: rebm/eval/table/spec.py).
Each metric of a row is stored, as soon as it is computed, in `<out>/rows/<row>.json` under a
hash of everything its value depends on (checkpoint and file contents, model and data settings,
the metric's settings and protocol version: rebm/eval/table/cache.py), and skipped when the same
command runs again: a killed or requeued job continues with the first metric not yet done;
`--force` recomputes the selected ones. Test-set metrics run one by one; the sample metrics of a
row share one generation pass. A row whose checkpoint is missing is one warning line naming the
row and the expected path; the other rows still run, and the command exits non-zero at the end,
naming the skipped rows. At the end rank 0 writes `<out>/table.md` and `<out>/table.csv` (mean ±
std over each seed group; rebm/eval/table/report.py) from every cached result of the table, and
files of the metrics (sample grids, counterfactual grids) go to `<out>/<row>/`. The evaluation
batch is the table's `batch_size` on any number of processes, so the numbers do not depend on it.

`--check` computes nothing and starts no process group: it loads every row's config as the run
would, lists each missing file once (checkpoint, or a file of the metrics, `Metric.files`) with
the rows that need it and where it comes from, and exits non-zero if one is missing; with
`--verbose` it first lists every row's files, present or missing. An original model config (or a folder
of them) in place of the table is evaluated with its dataset's protocol
(rebm/eval/table/original_configs.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, List, Optional

from rebm.config.sections import DistributedSection

# Everything else is imported once the arguments are good, so --help answers at once.


def load_tables(path: str, protocol: Optional[str] = None) -> List[Any]:
    """The tables of `path`: a table YAML, an original model config, or a folder of those."""
    from rebm.eval.table.original_configs import is_original_config, original_tables
    from rebm.eval.table.spec import TableError, read_mapping, table_from_mapping

    if os.path.isdir(path):
        return original_tables(path, protocol)
    raw = read_mapping(path)
    if is_original_config(raw):
        return original_tables(path, protocol)
    if protocol is not None:
        raise TableError(f"--protocol goes with original model configs; {path} is a table "
                         "(its own protocol)")
    return [table_from_mapping(raw, path)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rebm.eval.table", description=__doc__.splitlines()[0],
        epilog="launch on N processes with: torchrun --nproc_per_node=N -m rebm.eval.table ...")
    parser.add_argument("table", help="table YAML (experiments/paper/*.yaml), or an original "
                        "model config (model_configs/*.yaml of the original code) or a folder "
                        "of them")
    parser.add_argument("--checkpoints", dest="checkpoint_root", required=True, metavar="DIR",
                        help="folder the rows' checkpoint paths are relative to")
    parser.add_argument("--rows", nargs="+", metavar="ROW", help="only these rows (names or "
                        "groups); the report still shows every cached row")
    parser.add_argument("--metrics", nargs="+", metavar="METRIC", help="only these metrics")
    parser.add_argument("--out", help="output folder (default runs/tables/<table name>)")
    parser.add_argument("--force", action="store_true",
                        help="recompute the selected metrics even when they are cached")
    parser.add_argument("--check", action="store_true",
                        help="compute nothing: load every row's config, list the files each "
                        "row needs as present or missing, exit non-zero if one is missing")
    parser.add_argument("--verbose", action="store_true",
                        help="with --check: list every row's files, present or missing, before "
                        "the list of missing files")
    parser.add_argument("--ddp-timeout-s", type=float, default=DistributedSection.ddp_timeout_s,
                        metavar="SECONDS",
                        help="under torchrun: how long a rank waits for the others in a "
                        "collective before the table stops, naming the ranks that did not "
                        "arrive (default %(default)g, as a run's ddp_timeout_s)")
    parser.add_argument("--protocol", metavar="TABLE",
                        help="original model configs: the table whose metrics, batch size and "
                        "overrides they are evaluated with (default: the shipped paper table "
                        "of their dataset)")
    return parser


def select_all(specs, args) -> List[Any]:
    """The tables to run, narrowed by --rows and --metrics; a bad name is one line, at once.
    With several tables (a folder of original configs) --rows first picks the tables that have
    the rows, then a --metrics name must be a metric of one of those, and each table runs the
    named metrics it has."""
    from rebm.eval.table.spec import TableError, own_rows

    if len(specs) == 1:
        specs[0].select(args.rows, args.metrics)
        return specs
    names = {n for s in specs for r in s.rows for n in (r.name, r.group)}
    unknown = [r for r in args.rows or () if r not in names]
    if unknown:
        raise TableError(f"--rows '{unknown[0]}' is neither a row name nor a group of "
                         f"{args.table}")
    chosen = [s for s in specs if not args.rows or own_rows(s, args.rows)]
    metrics = {m for s in chosen for m in s.metrics}
    unknown = [m for m in args.metrics or () if m not in metrics]
    if unknown:
        from rebm.eval.registry import did_you_mean

        raise TableError(f"--metrics '{unknown[0]}' is not a metric of the selected tables "
                         f"({', '.join(s.stem for s in chosen)}); their metrics: "
                         f"{', '.join(sorted(metrics))}.{did_you_mean(unknown[0], sorted(metrics))}")
    if args.metrics:
        chosen = [s for s in chosen if set(args.metrics) & set(s.metrics)]
    return chosen


def check_timeout(timeout_s: float) -> None:
    """--ddp-timeout-s in the range of a run's ddp_timeout_s (rebm/config/ranges.py)."""
    from rebm.config.ranges import KEY_RANGES
    from rebm.eval.table.spec import TableError

    allowed = KEY_RANGES["ddp_timeout_s"]
    if not allowed.holds(timeout_s):
        raise TableError(f"--ddp-timeout-s {timeout_s:g} is out of range for "
                         f"{allowed.holder}; give a value in {allowed.text()}")


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from rebm.cli import collector_paused, user_errors_exit
    from rebm.eval.table.spec import TableError

    with user_errors_exit(), collector_paused():  # loading configs imports torch
        check_timeout(args.ddp_timeout_s)
        specs = load_tables(args.table, args.protocol)
        specs = select_all(specs, args)
        if os.environ.get("RANK", "0") == "0":
            for notice in (n for s in specs for n in s.notices):
                print(f"note: {notice}", file=sys.stderr, flush=True)
        if args.check:
            from rebm.eval.table.check import check

            return check(specs, args)
        if not os.path.isdir(args.checkpoint_root):
            raise TableError(f"--checkpoints folder '{args.checkpoint_root}' does not exist; pass "
                             "the folder the rows' checkpoint paths are relative to")
    from rebm.eval.table.runner import launch_tables

    return launch_tables(specs, args)


if __name__ == "__main__":
    sys.exit(main())
