"""One command per paper table: evaluate every row of a table YAML, then write table.md/.csv.

    python -m rebm.eval.table experiments/paper/cifar10.yaml --checkpoints DIR \\
        [--rows NAME|GROUP ...] [--metrics NAME ...] [--out DIR] [--force] [--check]
    torchrun --nproc_per_node=N -m rebm.eval.table experiments/paper/cifar10.yaml --checkpoints DIR
    python -m rebm.eval.table ORIGINAL/model_configs[/FILE.yaml] --checkpoints ORIGINAL \\
        [--protocol TABLE]

The rows run one after another in one process group (the table format: rebm/eval/table_spec.py).
Each metric of a row is stored, as soon as it is computed, in `<out>/rows/<row>.json` under a
hash of everything its value depends on (checkpoint and file contents, model and data settings,
the metric's settings and protocol version: rebm/eval/table_cache.py), and skipped when the same
command runs again: a killed or requeued job continues with the first metric not yet done;
`--force` recomputes the selected ones. Test-set metrics run one by one; the sample metrics of a
row share one generation pass. A row whose checkpoint is missing is one warning line naming the
row and the expected path; the other rows still run, and the command exits non-zero at the end,
naming the skipped rows. At the end rank 0 writes `<out>/table.md` and `<out>/table.csv` (mean ±
std over each seed group; rebm/eval/table_report.py) from every cached result of the table, and
files of the metrics (sample grids, counterfactual grids) go to `<out>/<row>/`. The evaluation
batch is the table's `batch_size` on any number of processes, so the numbers do not depend on it.

`--check` computes nothing and starts no process group: it loads every row's config as the run
would, lists each file a row needs (checkpoint, and every file of its metrics, `Metric.files`) as
present or missing, and exits non-zero if one is missing. An original model config (or a folder
of them) in place of the table is evaluated with its dataset's protocol
(rebm/eval/original_configs.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from rebm.errors import UserError
from rebm.eval.table_spec import own_metrics, own_rows, row_configs

LOGGER = logging.getLogger("rebm")


class RowsSkipped(UserError, RuntimeError):
    """Rows were skipped (checkpoint missing); the table of the others is written. One line."""


class TableRun:
    """The state of one run of a table on every rank (every rank calls every method)."""

    def __init__(self, spec, args, runtime, out: str):
        from rebm.eval.table_cache import FileHashes

        self.spec, self.runtime, self.out = spec, runtime, out
        self.checkpoints, self.force = args.checkpoints, args.force
        self.selected = spec.select(own_rows(spec, args.rows), own_metrics(spec, args.metrics))
        self.configs = row_configs(spec, self.checkpoints)
        self.hashes = FileHashes()  # rank 0's: every file is read once per run
        self.skipped: List[str] = []
        self.finished: List[str] = []  # rows whose selected metrics are all cached now
        self.current: Optional[str] = None  # the row running, "[2/4] name"
        self.stored: List[str] = []  # metrics of the current row stored by this run

    def keys(self, row, metrics) -> Optional[Dict[str, str]]:
        """{metric: cache key} of the row (rank 0; None when its checkpoint is missing)."""
        from rebm.eval.registry import metric_classes
        from rebm.eval.table_cache import metric_key

        path = os.path.join(self.checkpoints, row.checkpoint)
        if not os.path.isfile(path):
            return None
        checkpoint = self.hashes.sha256(path)
        return {cls.name: metric_key(self.configs[row.name][cls.name], cls, checkpoint,
                                     self.spec.batch_size, self.hashes)
                for cls in metric_classes(metrics)}

    def run(self) -> Dict[str, Any]:
        from rebm.distributed.collectives import decide_on_main, on_main
        from rebm.distributed.signals import stop_point_all_ranks
        from rebm.eval.metric import EvalError
        from rebm.eval.table_report import write_report

        for row in self.selected.rows:  # what a metric needs and this machine lacks: now
            problems = self.evaluator(row, self.selected.metrics).problems()
            if problems:
                raise EvalError(f"row {row.name}: {'; '.join(problems)}")
        total = len(self.selected.rows)
        for number, row in enumerate(self.selected.rows, start=1):
            stop_point_all_ranks(self.runtime)
            self.current, self.stored = f"[{number}/{total}] {row.name}", []
            self.run_row(row, self.current)
            self.finished.append(row.name)
        self.current = None
        values, missing = decide_on_main(self.runtime, self.collect, "read the table cache")

        def report() -> None:
            paths = write_report(self.spec, values, missing, self.out)
            LOGGER.info("table written to %s and %s", *paths)

        on_main(self.runtime, report, f"write the table into {self.out}")
        return values

    def run_row(self, row, label: str) -> None:
        from rebm.distributed.collectives import decide_on_main, on_main
        from rebm.eval.table_cache import cached_results, read_cache, start_force

        def look() -> Optional[Tuple[Dict[str, Any], Dict[str, str]]]:
            keys = self.keys(row, self.selected.metrics)
            return None if keys is None else (read_cache(self.out, row.name), keys)

        found = decide_on_main(self.runtime, look, f"look for row {row.name}'s checkpoint")
        if found is None:
            LOGGER.warning("%s: checkpoint missing: expected %s; the other rows still run",
                           label, os.path.join(self.checkpoints, row.checkpoint))
            self.skipped.append(row.name)
            return
        cache, keys = found
        cache.update(row=row.name, group=row.group, seed=row.seed, checkpoint=row.checkpoint)
        cached = [m for m in self.selected.metrics
                  if cached_results(cache, m, keys[m]) is not None]
        plan = self.plan(row, self.pending(cache, cached, label))
        order = [name for names in plan for name in names]
        if self.force:
            LOGGER.info("%s: --force: recomputing %s (%d of them had a cached value)", label,
                        ", ".join(order), len(set(order) & set(cached)))
            on_main(self.runtime, lambda: start_force(self.out, cache, order),
                    f"write the table cache of row {row.name}")
        else:
            LOGGER.info("%s: %d of %d metrics already computed%s", label,
                        len(self.selected.metrics) - len(order), len(self.selected.metrics),
                        f"; computing {', '.join(order)}" if order else "")
        for names in plan:
            self.run_metrics(row, names, cache, keys, label)

    def pending(self, cache, cached: List[str], label: str) -> List[str]:
        """The selected metrics to compute: every one under --force; else those not cached
        under their current key and those an unfinished --force run had yet to recompute (their
        cached values predate it; one line names them)."""
        from rebm.eval.table_cache import unfinished_force

        if self.force:
            return list(self.selected.metrics)
        forced, started = unfinished_force(cache)
        stale = [m for m in self.selected.metrics if m in forced and m in cached]
        if stale:
            LOGGER.info("%s: a --force run started %s stopped before recomputing %s; their "
                        "cached values predate it, so they are computed again", label, started,
                        ", ".join(stale))
        return [m for m in self.selected.metrics if m in stale or m not in cached]

    def plan(self, row, pending: List[str]) -> List[List[str]]:
        """`pending` in the order they run: one list per model (metric_overrides may change the
        model settings), each its test-set metrics then its sample metrics, in registry order."""
        from rebm.eval.metric import SAMPLES
        from rebm.eval.registry import metric_classes
        from rebm.eval.table_cache import model_settings

        by_model: Dict[str, List[str]] = {}
        ordered = metric_classes(pending)
        for cls in [c for c in ordered if c.source != SAMPLES] + [
                c for c in ordered if c.source == SAMPLES]:
            settings = model_settings(self.configs[row.name][cls.name])
            by_model.setdefault(json.dumps(settings, sort_keys=True, default=str),
                                []).append(cls.name)
        return list(by_model.values())

    def evaluator(self, row, names: List[str]):
        """The Evaluator of `names` (metrics of one model) of the row: each metric with its own
        config, files into <out>/<row>/."""
        from rebm.eval.evaluator import Evaluator

        configs = self.configs[row.name]
        return Evaluator(configs[names[0]], self.runtime, names, batch_size=self.spec.batch_size,
                         run_dir=os.path.join(self.out, row.name), configs=configs)

    def run_metrics(self, row, names: List[str], cache, keys: Dict[str, str], label: str
                    ) -> None:
        """Compute and store `names` (metrics of one model) of the row: the test-set metrics
        one by one, the sample metrics in one generation pass per set of samples they draw."""
        from rebm.distributed.signals import stop_point_all_ranks
        from rebm.eval.evaluator import load_eval_model
        from rebm.eval.metric import SAMPLES

        model = load_eval_model(self.configs[row.name][names[0]], self.runtime)
        evaluator = self.evaluator(row, names)
        for cls in evaluator.classes:
            if cls.source == SAMPLES:
                continue
            stop_point_all_ranks(self.runtime)
            start = time.monotonic()
            results = evaluator.evaluate_all_ranks(model, metrics=[cls.name]).by_metric
            self.store(cache, row, cls.name, keys[cls.name], results[cls.name], start, label)
        samples = [c.name for c in evaluator.classes if c.source == SAMPLES]
        if samples:
            stop_point_all_ranks(self.runtime)
            start = time.monotonic()
            for group in self.sample_passes(row, samples):
                found = evaluator.evaluate_all_ranks(model, metrics=group).by_metric
                for name in group:
                    self.store(cache, row, name, keys[name], found.get(name, {}), start, label)

    def sample_passes(self, row, names: List[str]) -> List[List[str]]:
        """The row's sample metrics by the samples their configs draw (metric_overrides may
        make them differ): one generation pass each."""
        from rebm.eval.samples import sample_settings
        from rebm.eval.table_cache import data_settings

        passes: Dict[str, List[str]] = {}
        for name in names:
            cfg = self.configs[row.name][name]
            drawn = json.dumps([sample_settings(cfg), data_settings(cfg)], sort_keys=True,
                               default=str)
            passes.setdefault(drawn, []).append(name)
        return list(passes.values())

    def store(self, cache, row, metric: str, key: str, results, start: float, label: str
              ) -> None:
        from rebm.distributed.collectives import on_main
        from rebm.eval.registry import metric_classes
        from rebm.eval.table_cache import store_result

        seconds = time.monotonic() - start
        cls = metric_classes([metric])[0]
        entry = {"key": key, "results": results, "seconds": round(seconds, 3),
                 "world_size": self.runtime.world_size, "protocol": cls.protocol,
                 "settings": cls.settings(self.configs[row.name][metric])}
        on_main(self.runtime, lambda: store_result(self.out, cache, metric, entry),
                f"write the table cache of row {row.name}")
        self.stored.append(metric)
        shown = ", ".join(f"{k} {v:.4g}" for k, v in results.items()
                          if isinstance(v, float))
        LOGGER.info("%s: %s done in %.1f s%s", label, metric, seconds,
                    f": {shown}" if shown else "")

    def stop_outcome(self) -> str:
        """What a stopped run finished, and how to go on (the line after "stopped by SIG")."""
        done = (f"rows finished: {', '.join(self.finished)}" if self.finished
                else "no row finished")
        if self.current is not None:
            stored = ", ".join(self.stored) if self.stored else "no metric"
            done += f"; in row {self.current}, {stored} computed"
        return (f"{done}. Every computed metric is cached in {self.out}/rows; run the same "
                "command to continue from there (the table is written at the end)")

    def collect(self):
        """(values, missing) of every row of the table from the caches (rank 0): a row's
        values are its metrics computed under the current keys."""
        from rebm.eval.table_cache import cached_results, read_cache, unfinished_force

        values: Dict[str, Dict[str, Any]] = {}
        missing: Dict[str, str] = {}
        for row in self.spec.rows:
            keys = self.keys(row, self.spec.metrics)
            if keys is None:
                missing[row.name] = os.path.join(self.checkpoints, row.checkpoint)
                continue
            cache = read_cache(self.out, row.name)
            forced, started = unfinished_force(cache)
            if forced:
                LOGGER.warning("row %s: %s in the table predate(s) a --force run started %s "
                               "that stopped; run the table again to recompute them", row.name,
                               ", ".join(forced), started)
            found: Dict[str, Any] = {}
            for metric in self.spec.metrics:
                found.update(cached_results(cache, metric, keys[metric]) or {})
            if found:
                values[row.name] = found
        return values, missing


# --------------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------------
def load_tables(path: str, protocol: Optional[str] = None) -> List[Any]:
    """The tables of `path`: a table YAML, an original model config, or a folder of those."""
    from rebm.eval.original_configs import is_original_config, original_tables
    from rebm.eval.table_spec import TableError, read_mapping, table_from_mapping

    if os.path.isdir(path):
        return original_tables(path, protocol)
    raw = read_mapping(path)
    if is_original_config(raw):
        return original_tables(path, protocol)
    if protocol is not None:
        raise TableError(f"--protocol goes with original model configs; {path} is a table "
                         "(its own protocol)")
    return [table_from_mapping(raw, path)]


def out_dir(spec, args, count: int) -> str:
    """A table's output folder: --out (one table) or --out/<table> (several), default
    runs/tables/<table>."""
    if args.out is None:
        return os.path.join("runs", "tables", spec.stem)
    return args.out if count == 1 else os.path.join(args.out, spec.stem)


STOP_NOTICE = ("stopping at the next batch; every metric computed so far stays cached "
               "(interrupt again to stop at once)")


def run_tables(specs, args, runtime) -> None:
    """Every rank: the tables one after another. A Ctrl-C or SIGTERM stops every rank at the
    next batch or metric, with one line naming what is finished."""
    from rebm.distributed.signals import Preempted, exit_stopped

    skipped: List[str] = []
    for spec in specs:
        table = TableRun(spec, args, runtime, out_dir(spec, args, len(specs)))
        try:
            table.run()
        except Preempted:
            exit_stopped(runtime, table.stop_outcome())
        skipped += table.skipped
    if skipped:  # every rank knows them (decided on rank 0, broadcast)
        raise RowsSkipped(f"{len(skipped)} row(s) skipped, checkpoint missing: "
                          f"{', '.join(skipped)}; the table of the other rows is written")


def log_dir(specs, args) -> str:
    """Where the ranks' logs go: the table's folder (one table), else --out or runs/tables."""
    if len(specs) == 1:
        return out_dir(specs[0], args, 1)
    return args.out or os.path.join("runs", "tables")


def run(specs, args) -> int:
    """Every process of the tables (under torchrun, every rank), through the entry points'
    launch (rebm.cli.launch): logs, the stop on a signal, the tables."""
    from rebm.cli import launch

    def body(_cfg, runtime, _args) -> None:
        from rebm.distributed import setup_logging
        from rebm.distributed.signals import stop_on_signal

        setup_logging(runtime, log_dir(specs, args))
        with stop_on_signal(runtime, STOP_NOTICE) as stoppable:
            run_tables(specs, args, stoppable)

    return launch(body, None, args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rebm.eval.table", description=__doc__.splitlines()[0],
        epilog="launch on N processes with: torchrun --nproc_per_node=N -m rebm.eval.table ...")
    parser.add_argument("table", help="table YAML (experiments/paper/*.yaml), or an original "
                        "model config (model_configs/*.yaml of the original code) or a folder "
                        "of them")
    parser.add_argument("--checkpoints", required=True, metavar="DIR",
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
    from rebm.eval.table_spec import TableError

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


def main(argv: Optional[List[str]] = None) -> int:
    from rebm.cli import collector_paused, user_errors_exit
    from rebm.eval.table_spec import TableError

    args = build_parser().parse_args(argv)
    with user_errors_exit(), collector_paused():  # loading configs imports torch
        specs = load_tables(args.table, args.protocol)
        specs = select_all(specs, args)
        if os.environ.get("RANK", "0") == "0":
            for notice in (n for s in specs for n in s.notices):
                print(f"note: {notice}", file=sys.stderr, flush=True)
        if args.check:
            from rebm.eval.table_check import check

            return check(specs, args)
        if not os.path.isdir(args.checkpoints):
            raise TableError(f"--checkpoints folder '{args.checkpoints}' does not exist; pass "
                             "the folder the rows' checkpoint paths are relative to")
    return run(specs, args)


if __name__ == "__main__":
    sys.exit(main())
