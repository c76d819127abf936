"""Loading a config: YAML file + command-line overrides -> validated, frozen TrainConfig.

Each source (the file, then the command line) is read as a raw mapping, its aliases are renamed
(aliases.py), and it is merged onto the dataclasses; `validate` then only checks. Errors are
raised as `ConfigError` with one line that names the key, the file and the fix; the entry points
print that line and exit non-zero without a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import fields, is_dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from rebm.config.aliases import apply_aliases
from rebm.config.datasets import INDIST_DATASETS, OUTDIST_DATASETS
from rebm.config.errors import ConfigError
from rebm.config.evaluation import validate_evaluation
from rebm.config.frozen import freeze
from rebm.config.layout import file_key, file_keys, file_leaves, to_file_layout, to_stored
from rebm.config.legacy import check_refused
from rebm.config.optimizers import OPTIMIZERS
from rebm.config.ranges import check_ranges
from rebm.config.schedule import check_lr_schedule_value
from rebm.config.schema import (
    AMP_MODES,
    ATTACK_TYPES,
    AUGMENTATIONS,
    DDP_BACKENDS,
    DEVICES,
    NORMS,
    RESUME_MODES,
    WANDB_MODES,
    WHICH_LOGIT,
    ModelConfig,
    TrainConfig,
)
from rebm.config.sections import AttackConfig
from rebm.registry import choice_message

VALID_KEYS = file_keys(TrainConfig())
_SECTION_PREFIXES = {key.rsplit(".", 1)[0] + "." for key in VALID_KEYS if "." in key}


def _dependent_defaults(schema: Any, explicit: Sequence[str]) -> None:
    """The defaults that depend on another field, set where the config leaves them unset."""
    data, model = schema.data, schema.model
    # a dataset's own class count and image size (its registry entry) where the config sets
    # none: the original's data.image_size default is 256, which its ImageNet configs rely on,
    # and its data.num_classes default, 1, fails on every multi-class dataset
    entry = INDIST_DATASETS.get(data.indist_dataset) if data.indist_dataset in INDIST_DATASETS \
        else None
    if entry and entry.image_size and "data.image_size" not in explicit:
        data.image_size = entry.image_size
    if entry and entry.num_classes and "data.num_classes" not in explicit:
        data.num_classes = entry.num_classes
    # the original's ConvNextConfig defaults use_convstem to true (its config_classes.py)
    if "model.use_convstem" not in explicit and str(model.model_type).lower().startswith(
            "convnext"):
        model.use_convstem = True


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, VALID_KEYS, n=1, cutoff=0.5)
    if not close:
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in VALID_KEYS if k.rsplit(".", 1)[-1].lower() == leaf.lower()]
    return f" Did you mean '{close[0]}'?" if close else ""


def _translate(err: OmegaConfBaseException, source: str) -> ConfigError:
    key = file_key(getattr(err, "full_key", None) or "?")
    if isinstance(err, ConfigKeyError) or "not in struct" in str(err) or "Key '" in str(err):
        return ConfigError(
            f"{source}: unknown config key '{key}'.{_suggest(key)} "
            f"(see docs/configs.md for every field)"
        )
    if isinstance(err, ValidationError):
        value = getattr(err, "value", None)
        msg = str(err).splitlines()[0]
        return ConfigError(f"{source}: wrong type for '{key}' (value {value!r}): {msg}")
    return ConfigError(f"{source}: invalid value for '{key}': {str(err).splitlines()[0]}")


def _explicit_keys(container: Any, prefix: str = "") -> List[str]:
    out = []
    if isinstance(container, dict):
        for key, value in container.items():
            out.append(f"{prefix}{key}")
            out.extend(_explicit_keys(value, f"{prefix}{key}."))
    return out


def _section_given_a_value(base: DictConfig, raw: Any, prefix: str = "") -> Optional[str]:
    """The first key of `raw` that is a section in `base` but holds a plain value (OmegaConf's
    error about it names no key), else None."""
    for key, value in raw.items() if isinstance(raw, DictConfig) else ():
        node = base.get(key) if key in base else None
        if isinstance(node, DictConfig):
            if not isinstance(value, DictConfig):
                return f"{prefix}{key}"
            found = _section_given_a_value(node, value, f"{prefix}{key}.")
            if found:
                return found
    return None


def _merge(base: DictConfig, other: Any, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        section = None if getattr(err, "full_key", None) else _section_given_a_value(base, other)
        if section:
            value = OmegaConf.select(other, section)
            raise ConfigError(
                f"{source}: '{file_key(section)}' is a section, not a value (got {value!r}); set "
                f"one of its keys instead, e.g. {file_key(section)}."
                f"{next(iter(OmegaConf.select(base, section)))}"
                "=...") from None
        raise _translate(err, source) from None


def _read_file(path: str) -> DictConfig:
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' does not exist; pass the path of a YAML file")
    try:
        loaded = OmegaConf.load(path)
    except Exception as err:  # yaml.YAMLError and friends
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"{path}: not valid YAML ({first})") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path}: the top level of a config must be a mapping of keys")
    return loaded


def _control_character(text: str) -> Optional[str]:
    """The name of the first control character of `text` ('a newline', 'U+0001'), else None."""
    names = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab"}
    for char in text:
        if ord(char) < 32 or ord(char) == 127:
            return names.get(char, f"the control character U+{ord(char):04X}")
    return None


def _refuse_control_characters(key: str, value: str, source: str) -> None:
    """A value with a newline or another control character: OmegaConf's override parser turns a
    newline into a space and fails on the others with YAML's traceback, and no path or name of
    a run means one."""
    found = _control_character(value)
    if found:
        raise ConfigError(f"{source}: the value of '{key}' holds {found} ({value!r}); write it "
                          "without control characters")


def _read_overrides(overrides: Sequence[str], source: str = "command line") -> DictConfig:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{source}: override '{item}' must look like key=value (e.g. "
                              "lr=0.01)")
        _refuse_control_characters(*item.split("=", 1), source)
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as err:
        raise ConfigError(f"{source}: cannot parse overrides: {err}") from None


# `${oc.env:NAME}` (OmegaConf's resolver) copies an environment variable into the config, and rebm
# records every resolved value (config.yaml, each training state, wandb): variables whose name says
# they hold a secret are refused (docs/checkpoints.md).
_ENV_READ = re.compile(r"\$\{oc\.env:\s*([^,}\s]+)")
_SECRET_WORDS = {"TOKEN", "SECRET", "KEY", "APIKEY", "PASSWORD", "PASSWD", "PASS", "CREDENTIAL",
                 "CREDENTIALS", "AUTH", "PRIVATE"}


def _refuse_secrets(raw: Any, source: str, prefix: str = "") -> None:
    """ConfigError naming the key whose value reads a secret-looking environment variable."""
    items = raw.items() if isinstance(raw, dict) else enumerate(raw) if isinstance(raw, list) else ()
    for key, value in items:
        if isinstance(value, (dict, list)):
            _refuse_secrets(value, source, f"{prefix}{key}.")
            continue
        for name in _ENV_READ.findall(value) if isinstance(value, str) else ():
            if set(re.split(r"[^A-Z0-9]+", name.upper())) & _SECRET_WORDS:
                raise ConfigError(
                    f"{source}: '{prefix}{key}' reads the environment variable {name}, whose "
                    "name says it holds a secret; rebm records every resolved value in "
                    "config.yaml, each training state and wandb, so a config may not read it")


def load_config(path: Optional[str], overrides: Sequence[str] = (),
                overrides_source: str = "command line") -> TrainConfig:
    """YAML file + dot-list overrides -> validated TrainConfig (raises ConfigError).
    `overrides_source` names where the overrides come from in errors (a table file's row, say)."""
    sources = [(path, _read_file(path))] if path is not None else []
    if overrides:
        sources.append((overrides_source, _read_overrides(overrides, overrides_source)))
    schema = OmegaConf.structured(TrainConfig)
    explicit: List[str] = []
    for source, raw in sources:
        apply_aliases(raw, source)
        container = OmegaConf.to_container(raw)
        explicit += _explicit_keys(container)
        _refuse_secrets(container, source)
        _refuse_unknown_keys(container, source)
        schema = _merge(schema, OmegaConf.create(to_stored(container)), source)
    _dependent_defaults(schema, explicit)
    try:
        cfg: TrainConfig = OmegaConf.to_object(schema)  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        raise _translate(err, path or overrides_source) from None
    try:
        validate(cfg, source=path or overrides_source)
    except ConfigError as err:
        if path and overrides and _file_alone_is_valid(path):  # the overrides broke it
            raise ConfigError(str(err).replace(f"{path}:", f"{overrides_source}:", 1)) from None
        raise
    return freeze(cfg, explicit)


def _refuse_unknown_keys(raw: Any, source: str, prefix: str = "") -> None:
    """ConfigError naming the first key of a source (in the file layout) that no field has; a
    key holding a mapping is looked into only when it names a section."""
    for key, value in raw.items() if isinstance(raw, dict) else ():
        dotted = f"{prefix}{key}"
        if dotted not in VALID_KEYS:
            while isinstance(value, dict) and value:  # name the whole key the source wrote
                key, value = next(iter(value.items()))
                dotted = f"{dotted}.{key}"
            stored_as = file_key(dotted)  # a section path (schedule.batch_size): its file key
            hint = (f" Did you mean '{stored_as}'? (files and overrides use the original's "
                    "keys)" if stored_as != dotted and stored_as in VALID_KEYS
                    else _suggest(dotted))
            raise ConfigError(f"{source}: unknown config key '{dotted}'.{hint} "
                              f"(see docs/configs.md for every field)")
        if isinstance(value, dict) and f"{dotted}." in _SECTION_PREFIXES:
            _refuse_unknown_keys(value, source, f"{dotted}.")


def _file_alone_is_valid(path: str) -> bool:
    try:
        load_config(path)
    except ConfigError:
        return False
    return True


def _check_choice(value: str, choices: Sequence[str], key: str, source: str) -> None:
    if value not in choices:
        raise ConfigError(choice_message(key, value, choices, source))


def _non_finite(obj: Any, prefix: str = "") -> Optional[Tuple[str, float]]:
    """The first (key, value) of a float setting that is NaN, or infinite where the key is not
    a radius (`eps`, `*_eps`: `.inf` means no radius); None when there is none."""
    for field in fields(obj):
        value, key = getattr(obj, field.name), f"{prefix}{field.name}"
        if is_dataclass(value):
            found = _non_finite(value, f"{key}.")
            if found:
                return found
        elif isinstance(value, float) and not math.isfinite(value):
            if math.isnan(value) or not (field.name == "eps" or field.name.endswith("_eps")):
                return key, value
    return None


def _checked_values(cfg: TrainConfig, source: str) -> Dict[str, Any]:
    """Every value by its file key, once each is a finite number in the range its consumer can
    hold (rebm.config.ranges) or a string without control characters."""
    found = _non_finite(cfg)
    if found:  # the range checks below let NaN through: every comparison with it is false
        raise ConfigError(f"{source}: '{file_key(found[0])}: {found[1]}' is not a finite number; set a "
                          "finite value (only a radius, *eps, may be .inf)")
    check_ranges(cfg, source)
    flat = {key: getattr(owner, f.name) for key, _, owner, f in file_leaves(cfg)}
    for key, value in flat.items():
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str):
                _refuse_control_characters(key, text, source)
    return flat


def validate(cfg: TrainConfig, source: str = "config") -> None:
    """Checks that need no world size; raises ConfigError naming the key. It changes nothing."""
    from rebm.models.registry import MODELS

    flat = _checked_values(cfg, source)
    INDIST_DATASETS.check(cfg.data.indist_dataset, source)
    OUTDIST_DATASETS.check(cfg.data.outdist_dataset, source)
    OPTIMIZERS.check(flat["optimizer"], source)
    _check_choice(flat["amp"], AMP_MODES, "amp", source)
    _check_choice(flat["wandb_mode"], WANDB_MODES, "wandb_mode", source)
    _check_choice(flat["ddp_backend"], DDP_BACKENDS, "ddp_backend", source)
    _check_choice(flat["device"], DEVICES, "device", source)
    _check_choice(flat["resume"], RESUME_MODES, "resume", source)
    _check_choice(cfg.model.which_logit, WHICH_LOGIT, "model.which_logit", source)
    _check_choice(flat["augm_type_generation"], AUGMENTATIONS, "augm_type_generation", source)
    _check_choice(
        flat["augm_type_classification"], AUGMENTATIONS, "augm_type_classification", source
    )
    _validate_openimages(cfg, source)
    check_refused(cfg, source)
    MODELS.check(cfg.model.model_type, source)
    _validate_family_options(cfg, source)
    for key, value in (("model.channels_last", cfg.model.channels_last),
                       ("model.compile", cfg.model.compile), ("fuse_attacks", flat["fuse_attacks"])):
        if value not in (True, False, "auto"):
            raise ConfigError(f"{source}: '{key}: {value}' is not valid; use true, false or auto")
    for name in ("attack", "indist_attack_clf"):
        attack: AttackConfig = getattr(cfg.method, name)
        _check_choice(attack.attack_type, ATTACK_TYPES, f"{name}.attack_type", source)
        _check_choice(attack.norm, NORMS, f"{name}.norm", source)
        if attack.step_size < 0:
            raise ConfigError(f"{source}: '{name}.step_size' must be >= 0, got {attack.step_size}")
        if not attack.eps > 0:
            raise ConfigError(f"{source}: '{name}.eps' must be > 0 (or .inf), got {attack.eps}")
        if attack.max_steps < 0 or attack.start_step < 0:
            raise ConfigError(f"{source}: '{name}.max_steps'/'start_step' must be >= 0")
    if cfg.method.attack.attack_type != "pgd":  # argmin_pgd ascends the cross-entropy of labels
        raise ConfigError(f"{source}: 'attack.attack_type: {cfg.method.attack.attack_type}' is for "
                          "indist_attack_clf only; the negatives' attack is pgd")
    if cfg.data.cutout_size is not None and cfg.data.cutout_size < 1:
        raise ConfigError(f"{source}: 'data.cutout_size' must be >= 1 (or null: image_size // 2),"
                          f" got {cfg.data.cutout_size}")
    if cfg.method.attack.start_step > cfg.method.attack.max_steps:
        raise ConfigError(
            f"{source}: 'attack.start_step' ({cfg.method.attack.start_step}) exceeds "
            f"'attack.max_steps' ({cfg.method.attack.max_steps})"
        )
    _validate_image_log(cfg, source)
    validate_evaluation(cfg, source)
    if flat["robust_eval_steps"] is not None and flat["robust_eval_steps"] < 0:
        raise ConfigError(f"{source}: 'robust_eval_steps' must be >= 0 or null")
    for key in ("batch_size", "min_imgs_per_threshold", "n_imgs_per_metrics_log",
                "n_imgs_per_image_log", "n_imgs_per_ckpt_save", "keep_last_states"):
        if flat[key] <= 0:
            raise ConfigError(f"{source}: '{key}' must be a positive integer, got {flat[key]}")
    for key in ("per_device_batch_size", "per_device_eval_batch_size", "max_steps",
                "total_epochs", "samples_per_attack_step", "n_imgs_per_evaluation_log",
                "max_grad_norm"):
        value = flat[key]
        if value is not None and value <= 0:
            raise ConfigError(f"{source}: '{key}' must be positive or null, got {value}")
    if flat["lr"] <= 0:
        raise ConfigError(f"{source}: 'lr' must be > 0, got {flat['lr']}")
    if not 0 <= flat["ema_decay"] < 1:
        raise ConfigError(f"{source}: 'ema_decay' must be in [0, 1), got {flat['ema_decay']}")
    if not 0 <= flat["AUC_th"] <= 1:  # 0: T advances whenever the window is full (tests use it)
        raise ConfigError(f"{source}: 'AUC_th' must be in [0, 1], got {flat['AUC_th']}")
    for key in ("wd", "r1reg"):
        if not flat[key] >= 0:
            raise ConfigError(f"{source}: '{key}' must be >= 0, got {flat[key]}")
    for key in ("num_classes", "image_size"):
        if getattr(cfg.data, key) < 1:
            raise ConfigError(f"{source}: 'data.{key}' must be >= 1, got {getattr(cfg.data, key)}")
    check_lr_schedule_value(flat["lr_schedule"], source)  # fixed_lr: a stage-2 rule (rebm/methods/stages.py)
    if cfg.data.num_workers < 0:
        raise ConfigError(f"{source}: 'data.num_workers' must be >= 0")


def _validate_family_options(cfg: TrainConfig, source: str) -> None:
    """A `model.*` option of other model families, set to a non-default value, is refused: the
    chosen model would ignore it."""
    from rebm.models.registry import all_family_options, family_options

    own = family_options(cfg.model.model_type)
    defaults = ModelConfig()
    for option in all_family_options():
        value = getattr(cfg.model, option)
        if option not in own and value != getattr(defaults, option):
            raise ConfigError(
                f"{source}: 'model.{option}: {value}' is an option of other model families; "
                f"{cfg.model.model_type} does not take it (remove it)")


def _validate_openimages(cfg: TrainConfig, source: str) -> None:
    data = cfg.data
    if data.openimages_augm is not None:
        _check_choice(data.openimages_augm, AUGMENTATIONS, "openimages_augm", source)
    if data.openimages_max_samples is not None and data.openimages_max_samples < 1:
        raise ConfigError(f"{source}: 'openimages_max_samples' must be >= 1 or null, got "
                          f"{data.openimages_max_samples}")


# `seed_images: gaussian` keeps a (3 S^2)^2 float64 covariance: 1.2 GB at 64 px, 180 GB at 224.
GAUSSIAN_SEED_MAX_IMAGE_SIZE = 64


def _validate_image_log(cfg: TrainConfig, source: str) -> None:
    """The ranges of the `image_log.*` fields (sample generation and its step sweep)."""
    log = cfg.image_log
    _check_choice(log.norm, NORMS, "image_log.norm", source)
    if log.step_size < 0 or log.num_steps < 0:
        raise ConfigError(f"{source}: 'image_log.step_size' and 'image_log.num_steps' must be >= 0")
    if not log.eps > 0:
        raise ConfigError(f"{source}: 'image_log.eps' must be > 0 (or .inf)")
    if log.seed_images == "gaussian" and cfg.data.image_size > GAUSSIAN_SEED_MAX_IMAGE_SIZE:
        side = 3 * cfg.data.image_size ** 2
        raise ConfigError(
            f"{source}: 'image_log.seed_images: gaussian' fits a full {side} x {side} covariance "
            f"at data.image_size={cfg.data.image_size}, too large above "
            f"{GAUSSIAN_SEED_MAX_IMAGE_SIZE} px; use noise, lowfreq-noise or a seed file")
    for key in ("num_samples", "sweep_num_samples"):
        if getattr(log, key) <= 0:
            raise ConfigError(
                f"{source}: 'image_log.{key}' must be a positive integer, got {getattr(log, key)}")
    if log.sweep_radius < 0:
        raise ConfigError(f"{source}: 'image_log.sweep_radius' must be >= 0, got {log.sweep_radius}")
    if log.step_sweep_range is not None and (
            not log.step_sweep_range or min(log.step_sweep_range) < 1):
        raise ConfigError(
            f"{source}: 'image_log.step_sweep_range' must be a non-empty list of step counts "
            f">= 1 (or null), got {list(log.step_sweep_range)}")
    if log.blur_kernel_size < 0 or (log.blur_kernel_size > 0 and log.blur_kernel_size % 2 == 0):
        raise ConfigError(
            f"{source}: 'image_log.blur_kernel_size' must be 0 (no blur) or an odd size >= 1, "
            f"got {log.blur_kernel_size}")


def to_yaml(cfg: TrainConfig) -> str:
    """The config in the file layout, as config.yaml holds it."""
    return yaml_of(to_dict(cfg))


def yaml_of(config: dict) -> str:
    """config.yaml's text of a config as to_dict gives it."""
    return OmegaConf.to_yaml(OmegaConf.create(config))


def to_dict(cfg: TrainConfig) -> dict:
    """The config as plain nested dicts and lists in the file layout (rebm/config/layout.py):
    what a training state, config.yaml and wandb store.
    For a loaded config (OmegaConf has already converted every value to its field's type, and the
    schema has no tuples or enums) dataclasses.asdict gives what
    OmegaConf.to_container(OmegaConf.structured(cfg)) gives, type for type, in 0.3 ms instead of
    40: it runs at every state save."""
    return to_file_layout(dataclasses.asdict(cfg))  # type: ignore[call-overload]
