"""What makes two configs the same experiment: the keys that decide what a run trains.

A run may be continued with other values of `RUN_KEYS` (how long it runs, where, on what hardware,
how often it logs, evaluates and saves, how it is evaluated), never with other values of the
rest. The default run directory is named after the config file and those training keys, so
re-running a command with a larger `max_steps` or `total_epochs` continues the same run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any, Dict, List, Optional, Sequence

from rebm.config.aliases import canonical_key
from rebm.config.layout import to_file_layout
from rebm.config.legacy import legacy_keys
from rebm.config.schema import TrainConfig

# Dotted keys (a section name covers the whole section) that do not change what a run trains.
RUN_KEYS = (
    "max_steps", "total_epochs", "run_dir", "resume", "resume_from_state",
    "keep_last_states", "wandb_project", "wandb_dir", "wandb_disabled", "wandb_mode", "tags",
    "progress_interval_s",
    "use_ddp", "ddp_backend", "device", "find_unused_parameters", "ddp_timeout_s",
    "ddp_step_timeout_s", "per_device_batch_size", "per_device_eval_batch_size",
    "n_imgs_per_metrics_log", "n_imgs_per_image_log", "n_imgs_per_evaluation_log",
    "n_imgs_per_ckpt_save", "robust_eval", "robust_eval_steps", "track_r1", "keep_samples",
    "data.num_workers", "data.download", "data.indist_ds_dir", "data.outdist_std_dir",
    "model.ckpt_path", "model.trust_checkpoint", "model.compile", "model.channels_last",
    "fuse_attacks",
    "image_log", "eval",
)

# Keys added to the schema whose default is not what runs from before them trained with: a saved
# config that lacks one, and reads what the key changes (the predicate of its flat config),
# compares as this value instead of the default. Runs that read TinyImages before its exclusion
# lists excluded no record; runs on other out-distributions never read the key.
VALUE_BEFORE_THE_KEY = {
    "data.tinyimages_exclusion_dir": (None, lambda saved: saved.get("data.outdist_dataset")
                                      in ("tinyimages", "80m-tinyimages")),
}


def flatten(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """{dotted key: value} of the leaves of nested dicts (a config as to_dict gives it)."""
    out: Dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _is_training_key(key: str, legacy: set) -> bool:
    return key not in legacy and not any(key == k or key.startswith(k + ".") for k in RUN_KEYS)


def training_diff(saved: Dict[str, Any], current: Dict[str, Any]) -> List[str]:
    """'key: saved -> current' for every training key whose value differs between two config
    dicts: `saved` (a state's or a config.yaml's) and `current` (this run's, as to_dict gives
    it). A key `saved` lacks (one added to the schema since it was written) compares as the value
    the older run trained with: its default, or its `VALUE_BEFORE_THE_KEY` where the default
    changed what such a run trains; an older run continues only while the new key has that
    value. A key `current` lacks (one removed from the schema since) is not compared: this rebm
    can neither set nor read it."""
    legacy = legacy_keys(TrainConfig)
    old, new = flatten(saved), flatten(current)
    defaults = flatten(to_file_layout(dataclasses.asdict(TrainConfig())))
    before_key = {key: value for key, (value, reads) in VALUE_BEFORE_THE_KEY.items() if reads(old)}
    defaults.update(before_key)
    diffs = []
    for key in sorted(new):
        if not _is_training_key(key, legacy):
            continue
        if key in old:
            if old[key] != new[key]:
                diffs.append(f"{key}: {old[key]!r} -> {new[key]!r}")
        elif key in defaults and defaults[key] != new[key]:
            before = "trained as" if key in before_key else "the default"
            diffs.append(f"{key}: unset ({before} {defaults[key]!r}) -> {new[key]!r}")
    return diffs


def default_run_dir(config_path: Optional[str], overrides: Sequence[str],
                    config: Optional[Dict[str, Any]] = None) -> str:
    """runs/<config folder>/<config file name>, plus a short hash of the training keys the
    command line sets (their resolved values in `config`, the loaded config as to_dict gives
    it, so lr=0.01 and lr=1e-2 agree): `lr=0.01` is another run, `max_steps=...` the same one."""
    if config_path:
        stem = os.path.splitext(os.path.basename(config_path))[0]
        folder = os.path.basename(os.path.dirname(os.path.abspath(config_path)))
        name = os.path.join(folder, stem)
    else:
        name = "run"
    legacy = legacy_keys(TrainConfig)
    given = {canonical_key(key): value for key, value in (o.split("=", 1) for o in overrides)}
    keys = sorted(k for k in given if _is_training_key(k, legacy))
    if keys:
        values = flatten(config) if config is not None else {}
        text = "\n".join(f"{k}={values.get(k, given[k])!r}" for k in keys)
        name += "-" + hashlib.sha256(text.encode()).hexdigest()[:8]
    return os.path.join("runs", name)
