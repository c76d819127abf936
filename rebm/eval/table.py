"""One command per paper table: evaluate every row of a table YAML, then write table.md/.csv.

    python -m rebm.eval.table experiments/paper/cifar10.yaml --checkpoints DIR \\
        [--rows NAME|GROUP ...] [--metrics NAME ...] [--out DIR] [--force]
    torchrun --nproc_per_node=N -m rebm.eval.table experiments/paper/cifar10.yaml --checkpoints DIR

The rows run one after another in one process group (the table format: rebm/eval/table_spec.py).
Each metric of a row is stored, as soon as it is computed, in `<out>/rows/<row>.json` under a
hash of what decides it (rebm/eval/table_cache.py), and skipped when the same command runs again:
a killed or requeued job continues with the first metric not yet done; `--force` recomputes the
selected ones. Test-set metrics run one by one; the sample metrics of a row share one generation
pass. A row whose checkpoint is missing is one warning line naming the row and the expected path;
the other rows still run. At the end rank 0 writes `<out>/table.md` and `<out>/table.csv` (mean ±
std over each seed group; rebm/eval/table_report.py) from every cached result of the table, and
files of the metrics (sample grids, counterfactual grids) go to `<out>/<row>/`. The evaluation
batch is the table's `batch_size` on any number of processes, so the numbers do not depend on it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any, Dict, List, Optional

LOGGER = logging.getLogger("rebm")


def model_identity(cfg) -> Dict[str, Any]:
    """The part of a row's config that decides its weights (the checkpoint apart)."""
    from rebm.config import to_dict

    model = {k: v for k, v in to_dict(cfg)["model"].items() if k != "ckpt_path"}
    return {"model": model, "use_ema": cfg.use_ema}


def row_configs(spec, checkpoints: str) -> Dict[str, Dict[str, Any]]:
    """{row: {metric: config}} of every row, loaded before any work: an unknown metric, a bad
    override or key stops the table at once, naming the row."""
    from rebm.config import ConfigError, load_config
    from rebm.eval.registry import metric_classes

    metric_classes(spec.metrics)  # EvalError on an unknown metric name
    configs: Dict[str, Dict[str, Any]] = {}
    for row in spec.rows:
        path = os.path.join(checkpoints, row.checkpoint)
        loaded: Dict[tuple, Any] = {}  # most metrics share the row's overrides: load those once
        configs[row.name] = {}
        for metric in spec.metrics:
            overrides = (*spec.row_overrides(row, metric), f"model.ckpt_path={path}")
            if overrides not in loaded:
                try:
                    loaded[overrides] = load_config(row.config, overrides)
                except ConfigError as err:
                    raise ConfigError(f"row {row.name}: {err}") from None
            configs[row.name][metric] = loaded[overrides]
    return configs


class _Recorded:
    """A sample metric whose own results are kept (the shared pass returns them merged)."""

    def __init__(self, metric):
        self.metric = metric
        self.results: Dict[str, Any] = {}

    def __getattr__(self, name: str):
        return getattr(self.metric, name)

    def finish(self) -> Dict[str, Any]:
        self.results = self.metric.finish()
        return self.results


class TableRun:
    """The state of one run of a table on every rank (every rank calls every method)."""

    def __init__(self, spec, args, runtime):
        self.spec, self.runtime = spec, runtime
        self.checkpoints, self.force = args.checkpoints, args.force
        self.out = args.out or os.path.join("runs", "tables", spec.stem)
        self.selected = spec.select(args.rows, args.metrics)
        self.configs = row_configs(spec, self.checkpoints)

    def key(self, row, metric: str, identity: Dict[str, Any]) -> str:
        from rebm.eval.registry import metric_classes
        from rebm.eval.table_cache import metric_key

        cfg = self.configs[row.name][metric]
        settings = metric_classes([metric])[0].settings(cfg)
        return metric_key(identity, model_identity(cfg), self.spec.batch_size, settings)

    def run(self) -> Dict[str, Any]:
        from rebm.distributed.collectives import decide_on_main, on_main
        from rebm.eval.evaluation import require_ready
        from rebm.eval.metric import EvalError, EvalSpec
        from rebm.eval.table_report import write_report

        for row in self.selected.rows:  # what a metric needs and this machine lacks: now
            for metric in self.selected.metrics:
                try:
                    require_ready(self.configs[row.name][metric], EvalSpec((metric,)))
                except EvalError as err:
                    raise EvalError(f"row {row.name}: {err}") from None
        total = len(self.selected.rows)
        for number, row in enumerate(self.selected.rows, start=1):
            self.run_row(row, f"[{number}/{total}] {row.name}")
        values, missing = decide_on_main(self.runtime, self.collect, "read the table cache")

        def report() -> None:
            paths = write_report(self.spec, values, missing, self.out)
            LOGGER.info("table written to %s and %s", *paths)

        on_main(self.runtime, report, f"write the table into {self.out}")
        return values

    def identity(self, row) -> Optional[Dict[str, Any]]:
        """The row's checkpoint identity (rank 0 looks, every rank gets it), None if missing."""
        from rebm.distributed.collectives import decide_on_main
        from rebm.eval.table_cache import checkpoint_identity

        path = os.path.join(self.checkpoints, row.checkpoint)
        return decide_on_main(
            self.runtime,
            lambda: checkpoint_identity(path, row.checkpoint) if os.path.isfile(path) else None,
            f"look for {path}")

    def run_row(self, row, label: str) -> None:
        from rebm.distributed.collectives import decide_on_main
        from rebm.eval.metric import SAMPLES
        from rebm.eval.registry import metric_classes
        from rebm.eval.table_cache import cached_results, read_cache

        identity = self.identity(row)
        if identity is None:
            LOGGER.warning("%s: checkpoint missing: expected %s; the other rows still run",
                           label, os.path.join(self.checkpoints, row.checkpoint))
            return
        cache = decide_on_main(self.runtime, lambda: read_cache(self.out, row.name),
                               "read the table cache")
        cache.update(row=row.name, group=row.group, seed=row.seed, checkpoint=row.checkpoint)
        keys = {m: self.key(row, m, identity) for m in self.selected.metrics}
        pending = [m for m in self.selected.metrics
                   if self.force or cached_results(cache, m, keys[m]) is None]
        done = len(self.selected.metrics) - len(pending)
        LOGGER.info("%s: %d of %d metrics already computed%s", label, done,
                    len(self.selected.metrics), f"; computing {', '.join(pending)}" if pending
                    else "")
        if not pending:
            return
        model = self.load_model(row, pending[0])
        for cls in metric_classes(pending):
            if cls.source == SAMPLES:
                continue
            start = time.monotonic()
            results = self.test_metric(model, row, cls.name)
            self.store(cache, row, cls.name, keys[cls.name], results, start, label)
        samples = [c.name for c in metric_classes(pending) if c.source == SAMPLES]
        if samples:
            start = time.monotonic()
            for name, results in self.sample_metrics(model, row, samples).items():
                self.store(cache, row, name, keys[name], results, start, label)

    def load_model(self, row, metric: str):
        from rebm.eval.evaluation import load_eval_model

        return load_eval_model(self.configs[row.name][metric], self.runtime)

    def test_metric(self, model, row, metric: str) -> Dict[str, Any]:
        from rebm.eval.evaluation import evaluate_model
        from rebm.eval.metric import EvalSpec

        spec = EvalSpec((metric,), self.spec.batch_size, os.path.join(self.out, row.name))
        return evaluate_model(model, self.configs[row.name][metric], self.runtime, spec)

    def sample_metrics(self, model, row, names: List[str]) -> Dict[str, Dict[str, Any]]:
        """The row's sample metrics, {name: results}: one generation pass for the metrics whose
        configs draw the same samples (metric_overrides may make them differ)."""
        from rebm.eval.samples import sample_settings

        passes: Dict[str, List[str]] = {}
        for name in names:
            drawn = json.dumps(sample_settings(self.configs[row.name][name]), sort_keys=True,
                               default=str)
            passes.setdefault(drawn, []).append(name)
        results: Dict[str, Dict[str, Any]] = {}
        for group in passes.values():
            results.update(self.sample_pass(model, row, group))
        return results

    def sample_pass(self, model, row, names: List[str]) -> Dict[str, Dict[str, Any]]:
        from rebm.eval.accuracy import eval_mode
        from rebm.eval.metric import EvalContext, EvalSpec
        from rebm.eval.registry import metric_classes
        from rebm.eval.samples import run_sample_pass

        cfg = self.configs[row.name][names[0]]
        spec = EvalSpec(tuple(names), self.spec.batch_size, os.path.join(self.out, row.name))
        ctx = EvalContext(model, cfg, self.runtime, spec, self.spec.batch_size)
        with eval_mode(model):
            recorded = [_Recorded(cls(ctx)) for cls in metric_classes(names)]
            if cfg.image_log.num_samples > 0:
                run_sample_pass(ctx, recorded)
        return {r.metric.name: r.results for r in recorded}

    def store(self, cache, row, metric: str, key: str, results, start: float, label: str
              ) -> None:
        from rebm.distributed.collectives import on_main
        from rebm.eval.table_cache import store_result

        seconds = time.monotonic() - start
        entry = {"key": key, "results": results, "seconds": round(seconds, 3),
                 "world_size": self.runtime.world_size,
                 "settings": self._settings(row, metric)}
        on_main(self.runtime, lambda: store_result(self.out, cache, metric, entry),
                f"write the table cache of row {row.name}")
        shown = ", ".join(f"{k} {v:.4g}" for k, v in results.items()
                          if isinstance(v, float))
        LOGGER.info("%s: %s done in %.1f s%s", label, metric, seconds,
                    f": {shown}" if shown else "")

    def _settings(self, row, metric: str) -> Dict[str, Any]:
        from rebm.eval.registry import metric_classes

        return metric_classes([metric])[0].settings(self.configs[row.name][metric])

    def collect(self):
        """(values, missing) of every row of the table from the caches (rank 0): a row's
        values are its metrics computed under the current keys."""
        from rebm.eval.table_cache import cached_results, checkpoint_identity, read_cache

        values: Dict[str, Dict[str, Any]] = {}
        missing: Dict[str, str] = {}
        for row in self.spec.rows:
            path = os.path.join(self.checkpoints, row.checkpoint)
            if not os.path.isfile(path):
                missing[row.name] = path
                continue
            identity = checkpoint_identity(path, row.checkpoint)
            cache = read_cache(self.out, row.name)
            found: Dict[str, Any] = {}
            for metric in self.spec.metrics:
                found.update(cached_results(cache, metric, self.key(row, metric, identity))
                             or {})
            if found:
                values[row.name] = found
        return values, missing


def run(spec, args) -> None:
    """One process of the table (under torchrun, every rank calls this)."""
    from rebm.cli import import_libraries, user_errors_exit

    import_libraries()  # first: its collector pause covers importing torch
    from torch.distributed.elastic.multiprocessing.errors import record

    from rebm.distributed import setup_distributed, setup_logging, teardown

    @record
    def worker() -> None:
        with user_errors_exit():
            runtime = setup_distributed()
            try:
                setup_logging(runtime, args.out or os.path.join("runs", "tables", spec.stem))
                TableRun(spec, args, runtime).run()
            finally:
                teardown(runtime)

    worker()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rebm.eval.table", description=__doc__.splitlines()[0],
        epilog="launch on N processes with: torchrun --nproc_per_node=N -m rebm.eval.table ...")
    parser.add_argument("table", help="table YAML (experiments/paper/*.yaml)")
    parser.add_argument("--checkpoints", required=True, metavar="DIR",
                        help="folder the rows' checkpoint paths are relative to")
    parser.add_argument("--rows", nargs="+", metavar="ROW", help="only these rows (names or "
                        "groups); the report still shows every cached row")
    parser.add_argument("--metrics", nargs="+", metavar="METRIC", help="only these metrics")
    parser.add_argument("--out", help="output folder (default runs/tables/<table name>)")
    parser.add_argument("--force", action="store_true",
                        help="recompute the selected metrics even when they are cached")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    from rebm.cli import user_errors_exit
    from rebm.eval.table_spec import load_table

    args = build_parser().parse_args(argv)
    with user_errors_exit():
        spec = load_table(args.table)
        spec.select(args.rows, args.metrics)  # a bad --rows/--metrics: one line, at once
    run(spec, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
