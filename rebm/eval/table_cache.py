"""The table runner's per-metric results cache: one JSON file per row, `<out>/rows/<row>.json`.

    {"row": NAME, "group": ..., "seed": ..., "checkpoint": PATH,
     "metrics": {METRIC: {"key": SHA256, "results": {...}, "settings": {...},
                          "seconds": ..., "world_size": ..., "finished": ISO time}}}

A metric's entry counts as computed when its key equals the key of the current run:
`metric_key` hashes the checkpoint file's identity (name, size, modification time), the row's
model (the config's `model` section and `use_ema`), the evaluation batch size and the metric's
own settings (everything that decides its value, `Metric.settings`). Other config changes (a
FID step count, say) do not invalidate the metrics they do not affect. Files are written
through a temporary file and os.replace, so a run killed at any point leaves a readable cache.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from typing import Any, Dict, Optional

from rebm.eval.report import jsonable


def checkpoint_identity(path: str, name: str) -> Dict[str, Any]:
    """What identifies a checkpoint file without reading it: its name in the table (relative
    to --checkpoints, so a moved checkpoint folder keeps its cache), size and mtime."""
    stat = os.stat(path)
    return {"name": name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def metric_key(identity: Dict[str, Any], model: Dict[str, Any], batch_size: int,
               settings: Dict[str, Any]) -> str:
    """The hash under which a metric's result is stored (see the module docstring)."""
    payload = json.dumps({"checkpoint": identity, "model": model, "batch_size": batch_size,
                          "settings": settings}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def cache_path(out_dir: str, row: str) -> str:
    return os.path.join(out_dir, "rows", f"{row}.json")


def read_cache(out_dir: str, row: str) -> Dict[str, Any]:
    """The row's cache, or an empty one when there is none (or it cannot be parsed)."""
    try:
        with open(cache_path(out_dir, row)) as fh:
            cache = json.load(fh)
    except (OSError, ValueError):
        return {"metrics": {}}
    if not isinstance(cache, dict) or not isinstance(cache.get("metrics"), dict):
        return {"metrics": {}}
    return cache


def cached_results(cache: Dict[str, Any], metric: str, key: str) -> Optional[Dict[str, Any]]:
    """The stored results of `metric` when they were computed under `key`, else None."""
    entry = cache["metrics"].get(metric)
    if isinstance(entry, dict) and entry.get("key") == key:
        return entry.get("results")
    return None


def store_result(out_dir: str, cache: Dict[str, Any], metric: str, entry: Dict[str, Any]
                 ) -> None:
    """Put one metric's entry into the row's cache and write the file atomically (rank 0)."""
    entry = {**entry, "finished": datetime.datetime.now().isoformat(timespec="seconds")}
    cache["metrics"][metric] = {k: _json_safe(v) for k, v in entry.items()}
    path = cache_path(out_dir, cache["row"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(cache, fh, indent=1)
    os.replace(tmp, path)


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return jsonable(value)
