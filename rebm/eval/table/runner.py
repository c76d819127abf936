"""The table runner's work: `TableRun` evaluates the selected rows and metrics of one table on
every rank (each metric cached as soon as it is computed, rebm/eval/table/cache.py), through one
Evaluator per row and model (rebm/eval/evaluator.py); `launch_tables` launches the tables'
processes through the entry points' launch (rebm.cli.launch), each running
`tables_process_all_ranks`. The command: rebm/eval/commands/table.py."""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from typing import Any, Dict, List, Optional, Tuple

from rebm.checkpoint.run_directory import RunDirectory
from rebm.cli import launch, start_up_timeout_advice
from rebm.config.sections import DistributedSection
from rebm.distributed import setup_logging
from rebm.distributed.collectives import decide_on_main, name_missing_ranks, on_main
from rebm.distributed.signals import (
    Preempted,
    exit_stopped,
    stop_on_signal,
    stop_point_all_ranks,
)
from rebm.errors import UserError
from rebm.eval.evaluator import Evaluator, load_eval_model
from rebm.eval.files import OutputFolderLock
from rebm.eval.metric import SAMPLES, EvalError
from rebm.eval.registry import metric_classes
from rebm.eval.sampling.samples import sample_settings
from rebm.eval.table.cache import (
    CHECKPOINT_SHA256,
    FileHashes,
    cached_results,
    data_settings,
    metric_key,
    model_settings,
    read_cache,
    start_force,
    store_result,
    unfinished_force,
    write_cache,
)
from rebm.eval.table.paths import looked_in, missing_data_paths
from rebm.eval.table.report import write_report
from rebm.eval.table.spec import own_metrics, own_rows, row_sections

LOGGER = logging.getLogger("rebm")


class RowsSkipped(UserError, RuntimeError):
    """Rows were skipped (checkpoint missing); the table of the others is written. One line."""


class TableRun:
    """The state of one run of a table on every rank (every rank calls every method)."""

    def __init__(self, spec, args, runtime, out: str):
        self.spec, self.runtime, self.out = spec, runtime, out
        self.checkpoint_root, self.force = args.checkpoint_root, args.force
        self.selected = spec.select(own_rows(spec, args.rows), own_metrics(spec, args.metrics))
        self.sections = row_sections(spec, self.checkpoint_root)  # {row: {metric: its section}}
        self.hashes = FileHashes()  # rank 0's: every file is read once per run
        self.skipped: List[str] = []
        self.finished: List[str] = []  # rows whose selected metrics are all cached now
        self.current: Optional[str] = None  # the row running, "[2/4] name"
        self.stored: List[str] = []  # metrics of the current row stored by this run

    def checkpoint_sha256(self, row) -> Optional[str]:
        """The content hash of the row's checkpoint (rank 0; None when it is missing)."""
        path = os.path.join(self.checkpoint_root, row.checkpoint)
        return self.hashes.sha256(path) if os.path.isfile(path) else None

    def keys(self, row, metrics, checkpoint: str) -> Dict[str, str]:
        """{metric: cache key} of the row for the checkpoint content `checkpoint` (rank 0)."""
        return {cls.name: metric_key(self.sections[row.name][cls.name],
                                     self.sections[row.name][cls.name].model, cls, checkpoint,
                                     self.spec.batch_size, self.hashes)
                for cls in metric_classes(metrics)}

    def run_all_ranks(self) -> Dict[str, Any]:
        held: List[OutputFolderLock] = []  # rank 0's: no other table writes into self.out
        decide_on_main(self.runtime, lambda: held.append(OutputFolderLock(self.out, "--out DIR")),
                       f"lock the output folder {self.out}")
        try:
            return self._run_all_ranks()
        finally:
            for lock in held:
                lock.release()

    def _run_all_ranks(self) -> Dict[str, Any]:
        for row in self.selected.rows:  # what a metric needs and this machine lacks: now
            problems = self.evaluator(row, self.selected.metrics).problems()
            if problems:
                raise EvalError(f"row {row.name}: {'; '.join(problems)}{self.looked_in(row)}")
        total = len(self.selected.rows)
        for number, row in enumerate(self.selected.rows, start=1):
            stop_point_all_ranks(self.runtime)
            self.current, self.stored = f"[{number}/{total}] {row.name}", []
            self.run_row_all_ranks(row, self.current)
            self.finished.append(row.name)
        self.current = None
        values, missing = decide_on_main(self.runtime, self.collect, "read the table cache")

        def report() -> None:
            paths = write_report(self.spec, values, missing, self.out)
            LOGGER.info("table written to %s and %s", *paths)

        on_main(self.runtime, report, f"write the table into {self.out}")
        return values

    def looked_in(self, row) -> str:
        """Where the row's relative data paths were looked for, when one of them is missing
        (the end of the line that stops the run)."""
        for metric in self.selected.metrics:
            missing = missing_data_paths(self.sections[row.name][metric],
                                         metric_classes([metric]), self.checkpoint_root)
            if missing:
                return f" (relative data paths: {looked_in(missing[0][2])})"
        return ""

    def run_row_all_ranks(self, row, label: str) -> None:
        def look() -> Optional[Tuple[Dict[str, Any], Dict[str, str], str]]:
            sha256 = self.checkpoint_sha256(row)
            if sha256 is None:
                return None
            return read_cache(self.out, row.name), self.keys(row, self.selected.metrics,
                                                             sha256), sha256

        found = decide_on_main(self.runtime, look, f"look for row {row.name}'s checkpoint")
        if found is None:
            LOGGER.warning("%s: checkpoint missing: expected %s; the other rows still run",
                           label, os.path.join(self.checkpoint_root, row.checkpoint))
            self.skipped.append(row.name)
            return
        cache, keys, sha256 = found
        recorded = cache.get(CHECKPOINT_SHA256)
        cache.update(row=row.name, group=row.group, seed=row.seed, checkpoint=row.checkpoint,
                     **{CHECKPOINT_SHA256: sha256})
        cached = [m for m in self.selected.metrics
                  if cached_results(cache, m, keys[m]) is not None]
        if cached and recorded != sha256:  # values with no record of their checkpoint: record
            on_main(self.runtime, lambda: write_cache(self.out, cache),
                    f"write the table cache of row {row.name}")
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
            self.run_metrics_all_ranks(row, names, cache, keys, label)

    def pending(self, cache, cached: List[str], label: str) -> List[str]:
        """The selected metrics to compute: every one under --force; else those not cached
        under their current key and those an unfinished --force run had yet to recompute (their
        cached values predate it; one line names them)."""
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
        by_model: Dict[str, List[str]] = {}
        ordered = metric_classes(pending)
        for cls in [c for c in ordered if c.source != SAMPLES] + [
                c for c in ordered if c.source == SAMPLES]:
            section = self.sections[row.name][cls.name]
            settings = model_settings(section.model, section.ema.use_ema)
            by_model.setdefault(json.dumps(settings, sort_keys=True, default=str),
                                []).append(cls.name)
        return list(by_model.values())

    def evaluator(self, row, names: List[str]):
        """The Evaluator of `names` (metrics of one model) of the row: each metric with its own
        evaluation section, files into <out>/<row>/."""
        sections = self.sections[row.name]
        return Evaluator(sections[names[0]], self.runtime, names, batch_size=self.spec.batch_size,
                         run_dir=os.path.join(self.out, row.name), sections=sections)

    def run_metrics_all_ranks(self, row, names: List[str], cache, keys: Dict[str, str],
                              label: str) -> None:
        """Compute and store `names` (metrics of one model) of the row: the test-set metrics
        one by one, the sample metrics in one generation pass per set of samples they draw."""
        section = self.sections[row.name][names[0]]
        model = load_eval_model(section.model, section.data, section.ema.use_ema, self.runtime)
        evaluator = self.evaluator(row, names)
        for cls in evaluator.classes:
            if cls.source == SAMPLES:
                continue
            stop_point_all_ranks(self.runtime)
            start = time.monotonic()
            results = evaluator.evaluate_all_ranks(model, metrics=[cls.name]).by_metric
            self.store_all_ranks(cache, row, cls.name, keys[cls.name], results[cls.name], start,
                                 label)
        samples = [c.name for c in evaluator.classes if c.source == SAMPLES]
        if samples:
            stop_point_all_ranks(self.runtime)
            start = time.monotonic()
            for group in self.sample_passes(row, samples):
                found = evaluator.evaluate_all_ranks(model, metrics=group).by_metric
                for name in group:
                    self.store_all_ranks(cache, row, name, keys[name], found.get(name, {}), start,
                                         label)

    def sample_passes(self, row, names: List[str]) -> List[List[str]]:
        """The row's sample metrics by the samples their configs draw (metric_overrides may
        make them differ): one generation pass each."""
        passes: Dict[str, List[str]] = {}
        for name in names:
            evaluation = self.sections[row.name][name]
            drawn = json.dumps([sample_settings(evaluation), data_settings(evaluation.data)],
                               sort_keys=True, default=str)
            passes.setdefault(drawn, []).append(name)
        return list(passes.values())

    def store_all_ranks(self, cache, row, metric: str, key: str, results, start: float,
                        label: str) -> None:
        seconds = time.monotonic() - start
        cls = metric_classes([metric])[0]
        entry = {"key": key, "results": results, "seconds": round(seconds, 3),
                 "world_size": self.runtime.world_size, "protocol": cls.protocol,
                 "settings": cls.settings(self.sections[row.name][metric])}
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
        values are its metrics computed under the current keys. The checkpoint of a row that
        --rows did not select is not read (gigabytes for ImageNet models): its keys take the
        checkpoint content recorded in its cache, and a run without --rows checks it."""
        selected = {row.name for row in self.selected.rows}
        values: Dict[str, Dict[str, Any]] = {}
        missing: Dict[str, str] = {}
        unread: List[str] = []
        for row in self.spec.rows:
            path = os.path.join(self.checkpoint_root, row.checkpoint)
            if not os.path.isfile(path):
                missing[row.name] = path
                continue
            cache = read_cache(self.out, row.name)
            sha256 = (self.hashes.sha256(path) if row.name in selected
                      else cache.get(CHECKPOINT_SHA256))
            found = self.cached_values(row, cache, sha256) if sha256 else {}
            if found:
                values[row.name] = found
                unread += [] if row.name in selected else [row.name]
        if unread:
            LOGGER.info("rows not selected by --rows (%s): shown with the values cached for "
                        "the checkpoint content recorded when they ran; their checkpoints were "
                        "not read again (a run without --rows checks them)", ", ".join(unread))
        return values, missing

    def cached_values(self, row, cache, sha256: str) -> Dict[str, Any]:
        """The row's results cached under its current keys for checkpoint content `sha256`
        (one warning when an unfinished --force run left some of them behind)."""
        keys = self.keys(row, self.spec.metrics, sha256)
        forced, started = unfinished_force(cache)
        if forced:
            LOGGER.warning("row %s: %s in the table predate(s) a --force run started %s "
                           "that stopped; run the table again to recompute them", row.name,
                           ", ".join(forced), started)
        found: Dict[str, Any] = {}
        for metric in self.spec.metrics:
            found.update(cached_results(cache, metric, keys[metric]) or {})
        return found


def out_dir(spec, args, count: int) -> str:
    """A table's output folder: --out (one table) or --out/<table> (several), default
    runs/tables/<table>."""
    if args.out is None:
        return os.path.join("runs", "tables", spec.stem)
    return args.out if count == 1 else os.path.join(args.out, spec.stem)


STOP_NOTICE = ("stopping at the next batch; every metric computed so far stays cached "
               "(interrupt again to stop at once)")


def run_tables_all_ranks(specs, args, runtime) -> None:
    """Every rank: the tables one after another. A Ctrl-C or SIGTERM stops every rank at the
    next batch or metric, with one line naming what is finished."""
    skipped: List[str] = []
    for spec in specs:
        table = TableRun(spec, args, runtime, out_dir(spec, args, len(specs)))
        try:
            table.run_all_ranks()
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


TIMEOUT_OPTION = "--ddp-timeout-s"


def tables_process_all_ranks(specs, runtime, args) -> None:
    """Every process of the tables (under torchrun, every rank): the entry's body, which
    `launch_tables` hands to the entry points' launch. Logs, the stop on a signal, the tables;
    a rank that does not arrive in a collective within the table's timeout is named in one
    line."""
    setup_logging(runtime, RunDirectory(log_dir(specs, args)).log_file(runtime.rank),
                  elsewhere="--out DIR")
    advice = start_up_timeout_advice(DistributedSection(ddp_timeout_s=args.ddp_timeout_s),
                                     TIMEOUT_OPTION)
    with stop_on_signal(runtime, STOP_NOTICE) as stoppable:
        with name_missing_ranks(stoppable, lambda: "in the table", advice):
            run_tables_all_ranks(specs, args, stoppable)


def launch_tables(specs, args) -> int:
    """The tables' processes, through the entry points' launch (rebm.cli.launch):
    `tables_process_all_ranks` on each, in a process group whose collectives wait at most
    `args.ddp_timeout_s` for a rank (the table's --ddp-timeout-s)."""
    return launch(functools.partial(tables_process_all_ranks, specs), args, 1,
                  DistributedSection(ddp_timeout_s=args.ddp_timeout_s), TIMEOUT_OPTION)
