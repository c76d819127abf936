"""A paper table as data: the table YAML (experiments/paper/*.yaml) read and checked.

    title: CIFAR-10, WideResNet-34-10        # the heading of table.md
    metrics: [accuracy, autoattack, fid]      # registered metric names, computed for every row
    batch_size: 250                           # images per evaluation batch, fixed (the numbers
                                              # then do not depend on the number of processes)
    overrides: [image_log.num_samples=50000]  # rebm key=value overrides of every row
    metric_overrides:                         # ... and of one metric only
      autoattack: [eval.num_images=1000]
    columns: {test_acc: clean acc}            # result keys shown, with their headers (optional)
    rows:
      - name: dat-t40-seed0                   # unique; --rows takes names or groups
        group: DAT (T=40)                     # rows of one group are averaged (default: name)
        seed: 0
        config: experiments/cifar10/cifar10-dat-WideResNet34x10-T40-seed0.yaml
        checkpoint: wandb/.../model_bestfid.pth   # relative to --checkpoints DIR
        overrides: [image_log.num_steps=33]
        baseline: false                       # true: a baseline, evaluated but not trained here
        source: where the checkpoint comes from
        notes: free text

Every problem is a `TableError`, one line naming the file, the row and the key.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from rebm.config import ConfigError, load_config
from rebm.config.views import EvaluationSection
from rebm.errors import UserError
from rebm.eval.metric import EvalError
from rebm.eval.registry import did_you_mean, metric_classes, metric_names
from rebm.eval.table.paths import rooted_config

TABLE_KEYS = ("title", "metrics", "batch_size", "overrides", "metric_overrides", "columns",
              "rows", "notes")
ROW_KEYS = ("name", "group", "seed", "config", "checkpoint", "overrides", "baseline", "source",
            "notes")
ROW_REQUIRED = ("name", "config", "checkpoint")
DEFAULT_BATCH_SIZE = 100
_OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")


class TableError(UserError, ValueError):
    """A table YAML the runner cannot use; one line."""


@dataclass(frozen=True)
class RowSpec:
    name: str
    group: str
    config: str
    checkpoint: str
    seed: Optional[int] = None
    overrides: Tuple[str, ...] = ()
    baseline: bool = False
    source: str = ""
    notes: str = ""


@dataclass(frozen=True)
class TableSpec:
    path: str
    title: str
    metrics: Tuple[str, ...]
    rows: Tuple[RowSpec, ...]
    batch_size: int = DEFAULT_BATCH_SIZE
    overrides: Tuple[str, ...] = ()
    metric_overrides: Dict[str, Tuple[str, ...]] = field(default_factory=dict)
    columns: Dict[str, str] = field(default_factory=dict)
    name: str = ""  # names the output folder; default: the file name without extension
    notices: Tuple[str, ...] = ()  # one line each, shown before the run (original model configs)

    @property
    def stem(self) -> str:
        return self.name or os.path.splitext(os.path.basename(self.path))[0]

    def row_overrides(self, row: RowSpec, metric: str) -> List[str]:
        """Overrides of `row` when computing `metric`: the table's, the row's, the metric's."""
        return [*self.overrides, *row.overrides, *self.metric_overrides.get(metric, ())]

    def select(self, rows: Optional[Sequence[str]], metrics: Optional[Sequence[str]]
               ) -> "TableSpec":
        """The table restricted to rows named (by name or group) and metrics named."""
        chosen_rows = self.rows
        if rows:
            unknown = [r for r in rows if not any(r in (x.name, x.group) for x in self.rows)]
            if unknown:
                raise TableError(f"{self.path}: --rows '{unknown[0]}' is neither a row name nor "
                                 f"a group; rows: {', '.join(x.name for x in self.rows)}")
            chosen_rows = tuple(x for x in self.rows if x.name in rows or x.group in rows)
        chosen_metrics = self.metrics
        if metrics:
            unknown = [m for m in metrics if m not in self.metrics]
            if unknown:
                raise TableError(f"{self.path}: --metrics '{unknown[0]}' is not a metric of this "
                                 f"table; its metrics: {', '.join(self.metrics)}."
                                 f"{did_you_mean(unknown[0], self.metrics)}")
            chosen_metrics = tuple(m for m in self.metrics if m in metrics)
        return replace(self, metrics=chosen_metrics, rows=chosen_rows)


def _overrides(value: Any, where: str) -> Tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TableError(f"{where} must be a list of key=value strings")
    bad = [v for v in value if not _OVERRIDE.match(v)]
    if bad:
        raise TableError(f"{where}: '{bad[0]}' is not a key=value override")
    return tuple(value)


def _row(raw: Any, index: int, path: str) -> RowSpec:
    where = f"{path}: rows[{index}]"
    if not isinstance(raw, dict):
        raise TableError(f"{where} must be a mapping with {', '.join(ROW_REQUIRED)}")
    unknown = [k for k in raw if k not in ROW_KEYS]
    if unknown:
        raise TableError(f"{where}: unknown key '{unknown[0]}'; row keys: {', '.join(ROW_KEYS)}")
    missing = [k for k in ROW_REQUIRED if not raw.get(k)]
    if missing:
        raise TableError(f"{where}: '{missing[0]}' is missing")
    name = str(raw["name"])
    if not re.fullmatch(r"[\w.+-]+", name):
        raise TableError(f"{where}: name '{name}' may hold only letters, digits and _ . + - "
                         "(it names the row's cache file)")
    seed = raw.get("seed")
    if seed is not None and not isinstance(seed, int):
        raise TableError(f"{where}: seed must be an integer, got {seed!r}")
    return RowSpec(name=name, group=str(raw.get("group") or name), config=str(raw["config"]),
                   checkpoint=str(raw["checkpoint"]), seed=seed,
                   overrides=_overrides(raw.get("overrides"), f"{where}.overrides"),
                   baseline=bool(raw.get("baseline", False)), source=str(raw.get("source", "")),
                   notes=str(raw.get("notes", "")))


def _metric_overrides(raw: Any, metrics: Sequence[str], path: str
                      ) -> Tuple[Dict[str, Tuple[str, ...]], List[str]]:
    """({metric: overrides} of the table's metrics, notices): overrides of a registered metric
    that the table does not run are one notice (dropping a metric is one edit), a name that is
    no metric at all is an error with the closest name."""
    if raw is None:
        return {}, []
    if not isinstance(raw, dict):
        raise TableError(f"{path}: metric_overrides must map metric names to override lists")
    overrides = {m: _overrides(v, f"{path}: metric_overrides.{m}") for m, v in raw.items()}
    unused = [m for m in raw if m not in metrics]
    if unused:
        unknown = [m for m in unused if m not in metric_names()]
        if unknown:
            raise TableError(f"{path}: metric_overrides names '{unknown[0]}', which is no metric."
                             f"{did_you_mean(unknown[0], [*metrics, *metric_names()])} The "
                             f"table's metrics: {', '.join(metrics)}")
    notices = [f"{path}: metric_overrides.{m} is not used: '{m}' is not in the table's metrics"
               for m in unused]
    return {m: v for m, v in overrides.items() if m in metrics}, notices


def read_mapping(path: str, what: str = "table file") -> Dict[str, Any]:
    """The YAML mapping in `path`; TableError (one line) when it cannot be read or is not one."""
    try:
        with open(path) as fh:
            raw = yaml.safe_load(fh)
    except OSError as err:
        raise TableError(f"{what} '{path}' cannot be read ({err.strerror or err})") from None
    except yaml.YAMLError as err:
        first = str(err).strip().splitlines()[0]
        raise TableError(f"{path} is not valid YAML ({first})") from None
    if not isinstance(raw, dict):
        raise TableError(f"{path} must be a YAML mapping: a table (metrics, rows) or an "
                         "original model config (method, dataset, checkpoint, model_type, ...)")
    return raw


def load_table(path: str) -> TableSpec:
    """The table at `path`, checked (metric names are checked against the registry by the
    runner)."""
    return table_from_mapping(read_mapping(path), path)


def table_from_mapping(raw: Dict[str, Any], path: str) -> TableSpec:
    """The table of a table file's mapping `raw` (read from `path`), checked."""
    unknown = [k for k in raw if k not in TABLE_KEYS]
    if unknown:
        raise TableError(f"{path}: unknown key '{unknown[0]}'; table keys: {', '.join(TABLE_KEYS)}")
    metrics = raw.get("metrics")
    if not isinstance(metrics, list) or not metrics or not all(isinstance(m, str) for m in metrics):
        raise TableError(f"{path}: metrics must be a non-empty list of metric names")
    if not isinstance(raw.get("rows"), list) or not raw["rows"]:
        raise TableError(f"{path}: rows must be a non-empty list")
    rows = tuple(_row(r, i, path) for i, r in enumerate(raw["rows"]))
    names = [r.name for r in rows]
    twice = [n for n in names if names.count(n) > 1]
    if twice:
        raise TableError(f"{path}: row name '{twice[0]}' appears twice")
    batch_size = raw.get("batch_size", DEFAULT_BATCH_SIZE)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise TableError(f"{path}: batch_size must be a positive integer, got {batch_size!r}")
    columns = raw.get("columns") or {}
    if not isinstance(columns, dict):
        raise TableError(f"{path}: columns must map result keys to headers")
    metric_overrides, notices = _metric_overrides(raw.get("metric_overrides"), metrics, path)
    return TableSpec(path=path, title=str(raw.get("title") or os.path.basename(path)),
                     metrics=tuple(dict.fromkeys(metrics)), rows=rows, batch_size=batch_size,
                     overrides=_overrides(raw.get("overrides"), f"{path}: overrides"),
                     metric_overrides=metric_overrides, notices=tuple(notices),
                     columns={str(k): str(v) for k, v in columns.items()})


def own_rows(spec, rows: Optional[List[str]]) -> Optional[List[str]]:
    """The names of --rows that are rows or groups of `spec` (several tables share --rows)."""
    if not rows:
        return None
    return [r for r in rows if any(r in (x.name, x.group) for x in spec.rows)]


def own_metrics(spec, metrics: Optional[List[str]]) -> Optional[List[str]]:
    """The names of --metrics that are metrics of `spec` (several tables share --metrics)."""
    if not metrics:
        return None
    return [m for m in metrics if m in spec.metrics]


def row_sections(spec, checkpoint_root: str) -> Dict[str, Dict[str, EvaluationSection]]:
    """{row: {metric: its evaluation section}} of every row, loaded before any work: an unknown
    metric, a bad override or key stops the table at once, naming the table file and the row.
    Relative data paths are read under `checkpoint_root` when they are there (rebm/eval/table/
    paths.py). Metrics with the same overrides share one section object."""
    try:
        classes = metric_classes(spec.metrics)
    except EvalError as err:
        raise EvalError(f"{spec.path}: metrics: {err}") from None
    sections: Dict[str, Dict[str, EvaluationSection]] = {}
    for row in spec.rows:
        path = os.path.join(checkpoint_root, row.checkpoint)
        loaded: Dict[tuple, EvaluationSection] = {}  # most metrics share the row's overrides
        sections[row.name] = {}
        for metric in spec.metrics:
            overrides = (*spec.row_overrides(row, metric), f"model.ckpt_path={path}")
            if overrides not in loaded:  # every metric's files: the configs stay shared
                loaded[overrides] = rooted_config(_row_config(spec, row, metric, overrides),
                                                  classes, checkpoint_root).evaluation
            sections[row.name][metric] = loaded[overrides]
    return sections


def _row_config(spec, row: RowSpec, metric: str, overrides: Tuple[str, ...]):
    """The config of `row` for `metric`. A ConfigError names the row and the list of overrides
    that broke it (the table's, the row's, the metric's, in the table file), found by loading
    them one list more at a time: only when the whole fails, so a good table loads once."""
    try:
        return load_config(row.config, overrides)
    except ConfigError as err:
        failure = err
    where = f"{spec.path}: rows[{spec.rows.index(row)}] ({row.name})"
    stages = [(spec.overrides, f"{spec.path}: overrides (row {row.name})"),
              (row.overrides, f"{where}.overrides"),
              (spec.metric_overrides.get(metric, ()),
               f"{spec.path}: metric_overrides.{metric} (row {row.name})")]
    checkpoint = overrides[-1:]  # model.ckpt_path=..., set by the runner
    so_far: Tuple[str, ...] = ()
    for added, source in stages:
        if not added:
            continue
        so_far = (*so_far, *added)
        try:
            load_config(row.config, (*so_far, *checkpoint), source)
        except ConfigError as err:
            message = str(err)
            raise ConfigError(message if source in message else f"row {row.name}: {message}"
                              ) from None
    raise ConfigError(f"row {row.name}: {failure}") from None
