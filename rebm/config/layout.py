"""The file layout of a config: where each top-level key of a YAML file (and of config.yaml, a
training state's config, wandb's) is stored in `TrainConfig`'s sections.

The original's files keep most keys at the top level and nest only `data`, `model`, `attack`,
`indist_attack_clf`, `image_log` (and rebm's `eval`); `TrainConfig` stores every key once, in the
section that owns it (schema.py, sections.py). `FILE_LAYOUT` is the one table between the two:
loading moves each file key to its section (`to_stored`), `to_dict` writes the file layout back,
key for key in the order the config files have always been written, so config.yaml, training
states, run-directory names and cache keys do not depend on how the sections are drawn (tests/
test_config_layout.py). The original's other spellings of keys are aliases (rebm/compat/
aliases.py), renamed before this table is read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import fields, is_dataclass
from typing import Any, Dict, Iterator, List, Tuple

from rebm.compat.config_fields import LegacyTrainFields

_SECTIONS_IN_THE_FILE = (
    ("data", "data"), ("attack", "method.attack"),
    ("indist_attack_clf", "method.indist_attack_clf"), ("model", "model"),
    ("image_log", "image_log"), ("eval", "eval"),
)
_TOP_LEVEL_KEYS = (
    ("optimizer", "optimization.name"), ("lr", "optimization.lr"), ("wd", "optimization.wd"),
    ("r1reg", "method.r1reg"), ("max_grad_norm", "optimization.max_grad_norm"),
    ("fixed_lr", "schedule.fixed_lr"), ("lr_schedule", "schedule.lr_schedule"),
    ("clf_indist_weight", "method.clf_indist_weight"),
    ("clf_outdist_weight", "method.clf_outdist_weight"),
    ("clf_adv_weight", "method.clf_adv_weight"),
    ("xent_indist_weight", "method.xent_indist_weight"),
    ("xent_outdist_weight", "method.xent_outdist_weight"),
    ("xent_adv_weight", "method.xent_adv_weight"),
    ("batch_size", "schedule.batch_size"),
    ("per_device_batch_size", "schedule.per_device_batch_size"),
    ("min_imgs_per_threshold", "method.min_imgs_per_threshold"), ("AUC_th", "method.AUC_th"),
    ("samples_per_attack_step", "method.samples_per_attack_step"),
    ("rand_seed", "schedule.rand_seed"), ("total_epochs", "schedule.total_epochs"),
    ("max_steps", "schedule.max_steps"),
    ("n_imgs_per_metrics_log", "intervals.n_imgs_per_metrics_log"),
    ("n_imgs_per_image_log", "intervals.n_imgs_per_image_log"),
    ("n_imgs_per_evaluation_log", "intervals.n_imgs_per_evaluation_log"),
    ("n_imgs_per_ckpt_save", "intervals.n_imgs_per_ckpt_save"),
    ("use_ema", "ema.use_ema"), ("ema_decay", "ema.ema_decay"), ("amp", "distributed.amp"),
    ("fuse_attacks", "method.fuse_attacks"), ("logsumexp", "method.logsumexp"),
    ("logsumexp_sampling", "method.logsumexp_sampling"),
    ("augm_type_classification", "data.augm_type_classification"),
    ("augm_type_generation", "data.augm_type_generation"),
    ("openimages_max_samples", "data.openimages_max_samples"),
    ("openimages_augm", "data.openimages_augm"), ("track_r1", "method.track_r1"),
    ("keep_samples", "eval.keep_samples"), ("robust_eval", "eval.robust_eval"),
    ("robust_eval_steps", "eval.robust_eval_steps"),
    ("per_device_eval_batch_size", "eval.per_device_eval_batch_size"),
    ("wandb_project", "logging.wandb_project"), ("wandb_dir", "logging.wandb_dir"),
    ("wandb_disabled", "logging.wandb_disabled"), ("wandb_mode", "logging.wandb_mode"),
    ("tags", "logging.tags"), ("run_dir", "run.run_dir"),
    ("resume_from_state", "run.resume_from_state"), ("resume", "run.resume"),
    ("keep_last_states", "run.keep_last_states"), ("use_ddp", "distributed.use_ddp"),
    ("ddp_backend", "distributed.ddp_backend"), ("device", "distributed.device"),
    ("sync_batchnorm", "distributed.sync_batchnorm"),
    ("find_unused_parameters", "distributed.find_unused_parameters"),
    ("ddp_timeout_s", "distributed.ddp_timeout_s"),
    ("ddp_step_timeout_s", "distributed.ddp_step_timeout_s"),
)
# Sections whose keys all sit at the file's top level (but the sections nested in the file): a
# key added to one is a top-level key of the file under its own name, written after the keys
# above, with no entry here.
FLAT_SECTIONS = ("method", "optimization", "schedule", "intervals", "ema", "logging", "run",
                 "distributed")


def _new_top_level_keys(listed: Tuple[Tuple[str, str], ...]) -> Tuple[Tuple[str, str], ...]:
    from rebm.config.schema import TrainConfig

    paths = {path for _, path in listed}
    config = TrainConfig()
    return tuple((f.name, f"{name}.{f.name}") for name in FLAT_SECTIONS
                 for f in fields(getattr(config, name))
                 if f"{name}.{f.name}" not in paths and not is_dataclass(
                     getattr(getattr(config, name), f.name)))


# (file key, stored path) of every top-level key of a file, in the order config.yaml writes them:
# the original's fields that do nothing here first (they stay on TrainConfig itself), then as
# the schema listed them when it was flat, then keys added since to the flat sections.
_LISTED = (*((f.name, f.name) for f in fields(LegacyTrainFields)),
           *_SECTIONS_IN_THE_FILE, *_TOP_LEVEL_KEYS)
FILE_LAYOUT: Tuple[Tuple[str, str], ...] = (*_LISTED, *_new_top_level_keys(_LISTED))
STORED_PATH: Dict[str, str] = dict(FILE_LAYOUT)
# stored paths that another file key claims: not part of their section's block in the file
_CLAIMED = {path for key, path in FILE_LAYOUT if key != path}


def _get(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def _section_leaves(section: Any, file_prefix: str, stored_prefix: str
                    ) -> Iterator[Tuple[str, str, Any, dataclasses.Field]]:
    for f in fields(section):
        stored = stored_prefix + f.name
        if stored in _CLAIMED:
            continue
        value = getattr(section, f.name)
        if is_dataclass(value):
            yield from _section_leaves(value, f"{file_prefix}{f.name}.", stored + ".")
        else:
            yield file_prefix + f.name, stored, section, f


def file_leaves(cfg: Any) -> Iterator[Tuple[str, str, Any, dataclasses.Field]]:
    """(file key, stored path, the section holding it, its field) of every leaf key of `cfg`,
    in file order: `attack.eps`, `method.attack.eps`, the AttackConfig, its `eps` field."""
    for key, path in FILE_LAYOUT:
        value = _get(cfg, path)
        if is_dataclass(value):
            yield from _section_leaves(value, key + ".", path + ".")
        else:
            parent, _, name = path.rpartition(".")
            owner = _get(cfg, parent) if parent else cfg
            yield key, path, owner, next(f for f in fields(owner) if f.name == name)


def file_key(stored: str) -> str:
    """The file's dotted key of a stored dotted path (`schedule.batch_size` -> `batch_size`,
    `method.attack.eps` -> `attack.eps`); a path of no key is returned as it is."""
    best = max((path for _, path in FILE_LAYOUT
                if stored == path or stored.startswith(path + ".")), key=len, default=None)
    if best is None:
        return stored
    key = next(k for k, p in FILE_LAYOUT if p == best)
    return key + stored[len(best):]


def to_file_layout(tree: Dict[str, Any]) -> Dict[str, Any]:
    """`dataclasses.asdict` of a TrainConfig -> the file layout (nested dicts, file order)."""
    out: Dict[str, Any] = {}
    for key, path in FILE_LAYOUT:
        node: Any = tree
        for name in path.split("."):
            node = node[name]
        out[key] = _without_claimed(node, path) if isinstance(node, dict) else node
    return out


def _without_claimed(node: Dict[str, Any], path: str) -> Dict[str, Any]:
    return {k: _without_claimed(v, f"{path}.{k}") if isinstance(v, dict) else v
            for k, v in node.items() if f"{path}.{k}" not in _CLAIMED}


def to_stored(raw: Dict[str, Any]) -> Dict[str, Any]:
    """A source's mapping in the file layout -> the stored layout (a key the layout does not
    know stays where it is: the merge names it)."""
    out: Dict[str, Any] = {}
    for key, value in raw.items():
        *parents, leaf = STORED_PATH.get(key, key).split(".")
        node = out
        for name in parents:
            node = node.setdefault(name, {})
        if isinstance(value, dict) and isinstance(node.get(leaf), dict):
            node[leaf].update(value)
        else:
            node[leaf] = value
    return out


def file_keys(cfg: Any) -> List[str]:
    """Every dotted key a file may set, sections included (`data`, `data.image_size`)."""
    keys = [key for key, path in FILE_LAYOUT if is_dataclass(_get(cfg, path))]
    return keys + [key for key, *_ in file_leaves(cfg)]


def replace(cfg: Any, **changes: Any) -> Any:
    """A frozen copy of a loaded config with top-level file keys changed (e.g. `run_dir`, chosen
    at start-up); it keeps the record of the keys the user set."""
    from rebm.config.frozen import explicit_keys, freeze

    copy = cfg
    for key, value in changes.items():
        copy = _replaced(copy, STORED_PATH.get(key, key).split("."), value)
    return freeze(copy, explicit_keys(cfg))


def _replaced(section: Any, path: List[str], value: Any) -> Any:
    head, *rest = path
    inner = _replaced(getattr(section, head), rest, value) if rest else value
    return dataclasses.replace(section, **{head: inner})
