"""The table runner's per-metric results cache: one JSON file per row, `<out>/rows/<row>.json`.

    {"row": NAME, "group": ..., "seed": ..., "checkpoint": PATH,
     "checkpoint_sha256": SHA256,   # the checkpoint's content when the row last ran
     "metrics": {METRIC: {"key": SHA256, "results": {...}, "settings": {...},
                          "seconds": ..., "world_size": ..., "finished": ISO time,
                          "checksum": SHA256}},   # of the rest of the entry
     "force": {"started": ISO time, "metrics": [METRIC, ...]}}   # only during a --force run

`checkpoint_sha256` lets the table show a row that `--rows` did not select without reading its
checkpoint again (gigabytes for ImageNet models): its values are those cached under the keys of
that recorded content (`TableRun.collect`).

`force` is written when a `--force` run starts on the row, naming the metrics it is to
recompute; each is taken off as its new value is stored, and the entry goes with the last. A
`force` entry found later is a `--force` run that was stopped: its metrics still hold values
from before it, and the next run recomputes them, saying so (`unfinished_force`).

A metric's entry counts as computed when its key equals the key of the current run and its
results are numbers (`cached_value_problem`: a string, list or null under a valid key is
computed again). The key
(`metric_key`) is a hash of everything the value depends on:
- the checkpoint's content (sha256 of the file, not its name, size or modification time);
- the row's model settings (the `model` section but its path, and `use_ema`) and data settings
  (the `data` section but the loader's worker count and the download switch);
- the content of every file the metric reads (`Metric.files`: statistics, seeds, reference
  batch, feature-network weights); folders (dataset roots) count by their absolute path, a
  missing file as missing;
- the table's evaluation batch size, the metric's `protocol` version and its `settings`.
Other config changes (a FID step count, say) do not invalidate the metrics they do not affect.
Each file is hashed once per run (`FileHashes`). Files are written through a temporary file and
os.replace, so a run killed at any point leaves a readable cache. A cache file that cannot be
read as one is set aside as `<file>.corrupt` with one warning line, and its metrics recomputed.

Each metric's entry carries a `checksum`: the sha256 of the rest of the entry (its key, results
and settings, as JSON with sorted keys), written with it (`store_result`). A flipped bit in a
value would otherwise show as another number in the table; an entry that does not match its
checksum is not served: the file is kept as `<file>.corrupt`, the entries that do match are
written back, and the others are computed again, with one warning line. A cache written before
checksums were (no entry has one) is not verified either: its file is kept as
`<file>.unverified`, one line says so, and its metrics are computed again.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
from typing import Any, Dict, List, Optional, Tuple

from rebm.config import DataConfig, ModelConfig
from rebm.config.views import EvaluationSection
from rebm.eval.files import write_text_replacing
from rebm.eval.results import jsonable
from rebm.eval.table.spec import TableError

LOGGER = logging.getLogger("rebm")

# data.* fields that decide how the data is read, never which values come out
DATA_FIELDS_WITHOUT_EFFECT = ("num_workers", "download")
# data.* fields of the training streams, which the key has never held: every evaluation reads
# its data un-augmented. (OOD detection against OpenImage-O does read openimages_max_samples,
# which its key lacks: a gap from before these fields were in `data`, left to a protocol bump.)
TRAINING_STREAM_FIELDS = ("augm_type_classification", "augm_type_generation", "openimages_augm",
                          "openimages_max_samples")
# model.* fields that are not settings of the network: its file (hashed by content instead) and
# whether that file may be unpickled
MODEL_FIELDS_WITHOUT_EFFECT = ("ckpt_path", "trust_checkpoint")
_CHUNK = 1 << 22


# Folders whose files are inputs of the value, counted by a manifest of their files (a dataset
# root counts by its path: hashing ImageNet's 1.3M files at every run would cost minutes)
FOLDERS_BY_CONTENT = ("image_log.seed_images",)


class FileHashes:
    """sha256 digests of files, each file read once for the lifetime of this object (one table
    run): a 1 GB checkpoint costs its read once, however many metrics and rows name it."""

    def __init__(self):
        self._digests: Dict[str, str] = {}

    def sha256(self, path: str) -> str:
        real = os.path.realpath(path)
        if real not in self._digests:
            digest = hashlib.sha256()
            with open(real, "rb") as fh:
                for block in iter(lambda: fh.read(_CHUNK), b""):
                    digest.update(block)
            self._digests[real] = digest.hexdigest()
        return self._digests[real]

    def folder_manifest(self, path: str) -> str:
        """sha256 of a folder's file list: every file's relative path, size and modification
        time, in sorted order (seed image folders: 50,000 files are listed in about a second,
        where reading them all would take minutes on a network file system)."""
        real = os.path.realpath(path)
        if real not in self._digests:
            digest = hashlib.sha256()
            for root, dirs, names in os.walk(real):
                dirs.sort()
                for name in sorted(names):
                    full = os.path.join(root, name)
                    stat = os.stat(full)
                    digest.update(f"{os.path.relpath(full, real)}\0{stat.st_size}\0"
                                  f"{stat.st_mtime_ns}\n".encode())
            self._digests[real] = digest.hexdigest()
        return self._digests[real]

    def identity(self, path: Optional[str], label: str = "") -> Optional[str]:
        """What a `Metric.files` entry contributes to a key: the file's content hash, a seed
        folder's manifest hash, another folder's (a dataset root's) absolute path, or that it is
        missing (None: the entry is not configured)."""
        if path is None:
            return None
        if os.path.isdir(path):
            if label in FOLDERS_BY_CONTENT:
                return f"folder manifest {self.folder_manifest(path)}"
            return f"folder {os.path.abspath(path)}"
        if os.path.isfile(path):
            return f"sha256 {self.sha256(path)}"
        return f"missing {os.path.abspath(path)}"


def model_settings(model: ModelConfig, use_ema: bool) -> Dict[str, Any]:
    """The resolved settings that decide the row's network apart from its weights file."""
    fields = dataclasses.asdict(model)  # what the whole config's to_dict holds under "model"
    return {"model": {k: v for k, v in fields.items() if k not in MODEL_FIELDS_WITHOUT_EFFECT},
            "use_ema": use_ema}


def data_settings(data: DataConfig) -> Dict[str, Any]:
    """The resolved `data` section but the fields that cannot change a value and those of the
    training streams (they joined the section after the keys were made)."""
    fields = dataclasses.asdict(data)
    return {k: v for k, v in fields.items()
            if k not in DATA_FIELDS_WITHOUT_EFFECT + TRAINING_STREAM_FIELDS}


def metric_key(evaluation: EvaluationSection, model: ModelConfig, metric_cls,
               checkpoint_sha256: str, batch_size: int, hashes: FileHashes) -> str:
    """The hash under which `metric_cls`'s value for the row's `evaluation` section and `model`
    section is stored (module docstring)."""
    files = {label: hashes.identity(path, label)
             for label, path in metric_cls.files(evaluation).items()}
    payload = {"checkpoint": checkpoint_sha256, **model_settings(model, evaluation.ema.use_ema),
               "data": data_settings(evaluation.data), "files": files, "batch_size": batch_size,
               "metric": metric_cls.name, "protocol": metric_cls.protocol,
               "settings": metric_cls.settings(evaluation)}
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


CHECKPOINT_SHA256 = "checkpoint_sha256"  # the cache entry recording the checkpoint's content


def cache_path(out_dir: str, row: str) -> str:
    return os.path.join(out_dir, "rows", f"{row}.json")


def _shape_problem(cache: Any) -> Optional[str]:
    """Why `cache` is not a results cache (None: it is one)."""
    if not isinstance(cache, dict) or not isinstance(cache.get("metrics"), dict):
        return "no 'metrics' mapping"
    for name, entry in cache["metrics"].items():
        if not (isinstance(entry, dict) and isinstance(entry.get("key"), str)
                and isinstance(entry.get("results"), dict)):
            return f"metric '{name}' has no key and results"
    return None


def read_cache(out_dir: str, row: str) -> Dict[str, Any]:
    """The row's cache, or an empty one when there is none. A file that cannot be read as a
    cache is moved to `<file>.corrupt` (nothing is lost) with one warning line; its metrics are
    then recomputed. Entries that do not match their checksum are left out likewise
    (`_without_unverified`). Rank 0 only."""
    path = cache_path(out_dir, row)
    try:
        with open(path) as fh:
            cache = json.load(fh)
        problem = _shape_problem(cache)
    except FileNotFoundError:
        return {"metrics": {}}
    except OSError as err:  # a permission, a folder in its place: not something to set aside
        raise TableError(f"table cache {path} cannot be read ({err.strerror or err}); fix its "
                         "permissions or remove it") from None
    except (ValueError, RecursionError) as err:  # not JSON, not UTF-8, nested too deep
        problem = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if problem is None:
        return _without_unverified(path, cache)
    os.replace(path, f"{path}.corrupt")
    LOGGER.warning("table cache %s is not a results cache (%s); kept as %s.corrupt, and its "
                   "metrics are computed again", path, problem, path)
    return {"metrics": {}}


CHECKSUM = "checksum"  # a metric entry's sha256 of the rest of the entry


def entry_checksum(entry: Dict[str, Any]) -> str:
    """The sha256 of a metric's cache entry but its checksum, as JSON with sorted keys (what
    json.dump writes reads back as the same values, so the sum is that of the written entry)."""
    rest = {k: v for k, v in entry.items() if k != CHECKSUM}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def _without_unverified(path: str, cache: Dict[str, Any]) -> Dict[str, Any]:
    """`cache` (read from `path`) without the metric entries that do not match their checksum;
    when there are any, the file is kept beside (`.corrupt`: damaged; `.unverified`: written
    before entries had checksums) and the verified entries are written back, with one line."""
    metrics = cache["metrics"]
    unverified = [name for name, entry in metrics.items()
                  if entry.get(CHECKSUM) != entry_checksum(entry)]
    if not unverified:
        return cache
    damaged = [name for name in unverified if CHECKSUM in metrics[name]]
    if damaged:
        aside = f"{path}.corrupt"
        why = f"is damaged: the values of {', '.join(damaged)} do not match their checksum"
    else:
        aside = f"{path}.unverified"
        why = ("holds values written without a checksum (by an earlier rebm), which cannot be "
               "verified")
    kept = {**cache, "metrics": {k: v for k, v in metrics.items() if k not in unverified}}
    try:
        os.replace(path, aside)
        write_text_replacing(path, json.dumps(kept, indent=1))
    except OSError as err:
        raise TableError(f"table cache {path} cannot be set aside as {aside} ("
                         f"{err.strerror or err}); fix the permissions of its folder") from None
    LOGGER.warning("table cache %s %s; kept as %s, and %s computed again", path, why, aside,
                   ", ".join(unverified))
    return kept


def cached_value_problem(results: Dict[str, Any]) -> Optional[str]:
    """Why stored results are not a metric's values (None: they are): every value is a number,
    or "inf" / "-inf" (how JSON stores an infinity); a string, list, mapping, boolean or null
    (a NaN) was not written by a finished computation, or is no value to show."""
    for name, value in results.items():
        if value in ("inf", "-inf"):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"'{name}' holds {json.dumps(value)[:40]}, not a number"
    return None


def cached_results(cache: Dict[str, Any], metric: str, key: str) -> Optional[Dict[str, Any]]:
    """The stored results of `metric` when they were computed under `key` and are numbers
    (`cached_value_problem`), else None: not computed."""
    entry = cache["metrics"].get(metric)
    if isinstance(entry, dict) and entry.get("key") == key:
        results = entry.get("results")
        if isinstance(results, dict) and cached_value_problem(results) is None:
            return results
    return None


def unfinished_force(cache: Dict[str, Any]) -> Tuple[List[str], str]:
    """(metrics, start time) of a `--force` run on the row that stopped before recomputing
    them; ([], "") when there was none."""
    force = cache.get("force")
    if not isinstance(force, dict) or not isinstance(force.get("metrics"), list):
        return [], ""
    return [str(m) for m in force["metrics"]], str(force.get("started", "?"))


def start_force(out_dir: str, cache: Dict[str, Any], metrics: List[str]) -> None:
    """Record in the row's cache that a `--force` run is to recompute `metrics` (with those of
    an earlier unfinished one), before it computes anything (rank 0)."""
    earlier, _ = unfinished_force(cache)
    cache["force"] = {"started": datetime.datetime.now().isoformat(timespec="seconds"),
                      "metrics": list(dict.fromkeys([*earlier, *metrics]))}
    write_cache(out_dir, cache)


def store_result(out_dir: str, cache: Dict[str, Any], metric: str, entry: Dict[str, Any]
                 ) -> None:
    """Put one metric's entry into the row's cache and write the file atomically (rank 0)."""
    entry = {**entry, "finished": datetime.datetime.now().isoformat(timespec="seconds")}
    entry = {k: _json_safe(v) for k, v in entry.items() if k != CHECKSUM}
    cache["metrics"][metric] = {**entry, CHECKSUM: entry_checksum(entry)}
    forced, _ = unfinished_force(cache)
    if metric in forced:
        forced.remove(metric)
        if forced:
            cache["force"]["metrics"] = forced
        else:
            del cache["force"]
    write_cache(out_dir, cache)


def write_cache(out_dir: str, cache: Dict[str, Any]) -> None:
    """Write the row's cache atomically (rank 0): a run killed at any point leaves it readable."""
    write_text_replacing(cache_path(out_dir, cache["row"]), json.dumps(cache, indent=1))


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return jsonable(value)
