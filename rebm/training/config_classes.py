"""Typed experiment configuration.

One YAML file is one experiment. It is merged onto the dataclasses below (field names are those of
the original DAT configs, so existing experiment files load unchanged), then `key=value` /
`a.b=value` overrides from the command line (OmegaConf dot-list) are applied on top.

Errors are raised as `ConfigError` with one line that names the key, the file and the fix; the
entry points print that line and exit non-zero without a traceback.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from rebm.errors import UserError

LOGGER = logging.getLogger(__name__)


class ConfigError(UserError, ValueError):
    """A configuration problem the user can fix; its message is one line."""


# --------------------------------------------------------------------------------------------
# Choices (validated by hand: OmegaConf does not check typing.Literal)
# --------------------------------------------------------------------------------------------
INDIST_DATASETS = (
    "cifar10",
    "cifar10-conditional",
    "cifar100",
    "cifar100-conditional",
    "digits",
    "imagefolder",
)
OUTDIST_DATASETS = (
    "tinyimages",
    "80m-tinyimages",
    "imagefolder",
    "tensorfile",
    "noise",
    "uniform-noise",
    "lowfreq-noise",
)
AUGMENTATIONS = ("original", "autoaugment_cutout", "none", "test")
OPTIMIZERS = ("sgd", "adam", "adamw")
ATTACK_TYPES = ("pgd",)
NORMS = ("L2", "Linf")
AMP_MODES = ("none", "bf16", "fp16")
WANDB_MODES = ("auto", "online", "offline", "disabled")
DDP_BACKENDS = ("auto", "nccl", "gloo")
DEVICES = ("auto", "cpu", "cuda")
RESUME_MODES = ("auto", "never")
WHICH_LOGIT = ("first", "all", "bird")


@dataclass
class AttackConfig:
    """PGD threat model. `attack` = negatives (generation), `indist_attack_clf` = adversarial
    training of the classifier."""

    attack_type: str = "pgd"  # only pgd (the original's adam attack is not supported)
    max_steps: int = 0  # attack: curriculum cap on T; indist_attack_clf: PGD steps K
    fixed_steps: Optional[int] = None  # original field, unused
    start_step: int = 0  # attack: T at the start of training
    step_size: float = 0.1  # alpha: L2 normalised-gradient step length (Linf: sign step)
    eps: float = math.inf  # radius around the start point; .inf = only the [0, 1] clamp
    norm: str = "L2"  # L2 or Linf
    lr: Optional[float] = None  # Adam-attack step of the original, unused
    random_start: bool = False  # start at a random point of the eps-ball (seeded per sample)


@dataclass
class ImageLogConfig:
    """Class-conditional sample generation (images and FID)."""

    attack_type: str = "pgd"  # original field, unused (generation is PGD)
    num_steps: int = 20  # PGD steps from the seed images
    log_fid: bool = False  # compute FID of the samples (needs local Inception weights)
    data_dir: Optional[str] = None  # FID reference statistics (.npz with mu, sigma)
    ood_data_dir: Optional[str] = None  # original field, unused
    img_extension: Optional[str] = None  # original field, unused
    num_samples: int = 100  # samples per evaluation, labels balanced over the classes
    save_dir: Optional[str] = None  # original field, unused (grids go to <run_dir>/samples)
    target_class: Optional[int] = None  # original field, unused
    adaptive_steps: bool = False  # original field, unused
    step_sweep_range: Optional[List[int]] = None  # original field, unused
    sweep_num_samples: int = 500  # original field, unused
    lr: Optional[float] = None  # original field, unused
    step_size: float = 0.1  # PGD step length of generation
    eps: float = math.inf  # PGD radius of generation
    seed_images: str = "noise"  # generation starts from: noise, lowfreq-noise, gaussian (fitted to the data), a .pt/.npz file or a folder


@dataclass
class DataConfig:
    indist_dataset: str = "cifar10-conditional"  # cifar10(-conditional), cifar100(-conditional), digits, imagefolder
    indist_ds_dir: str = "./data"  # dataset root (torchvision layout; imagefolder: train/ and test/)
    mixed_id: bool = False  # original field, unused
    outdist_dataset: str = "noise"  # tinyimages, imagefolder, tensorfile, noise/uniform-noise, lowfreq-noise
    outdist_std_dir: str = "./data"  # folder of tiny_images.bin / image folder / tensor file path
    num_workers: int = 2  # loader workers per process (capped by the cores per process)
    num_classes: int = 10  # classes of the in-distribution
    image_size: int = 32  # side of the images fed to the model
    download: bool = False  # let torchvision download CIFAR if it is missing
    outdist_exclude_index: Optional[str] = None  # TinyImages: file of 0-based record indices to skip


@dataclass
class ModelConfig:
    model_type: str = "WideResNet34x10"  # one of rebm.models.MODEL_NAMES
    ckpt_path: Optional[str] = None  # weights to start from (any format load_checkpoint reads)
    which_logit: str = "first"  # original field, unused
    normalize_input: bool = True  # normalise inputs inside the model (CIFAR-10 statistics)
    use_batchnorm: bool = False  # false: BatchNorm frozen in eval mode while training (DAT stage 2)
    use_layernorm: bool = True  # original ConvNext field, unused
    model_prefix: str = ""  # original ConvNext field, unused
    drop_path_rate: float = 0.1  # original ConvNext field, unused
    head_init_scale: float = 1.0  # original ConvNext field, unused
    model_id: str = "convnextv2_base"  # original ConvNext field, unused
    use_convstem: bool = True  # original ConvNext field, unused
    channels_last: bool = False  # channels_last memory format (faster convolutions on GPU)
    compile: bool = False  # torch.compile the model (before DDP wrapping)


@dataclass
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    indist_attack_clf: AttackConfig = field(
        default_factory=lambda: AttackConfig(max_steps=10, step_size=0.1, eps=0.5)
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    image_log: ImageLogConfig = field(default_factory=ImageLogConfig)

    # Optimisation
    optimizer: str = "sgd"  # sgd (momentum 0.9, nesterov), adam (betas 0, 0.99), adamw (0.9, 0.95)
    lr: float = 1e-3  # constant learning rate
    wd: float = 5e-4  # weight decay
    r1reg: float = 0.0  # weight of 1/2 mean ||grad_x s(x_in)||^2
    fixed_lr: bool = True  # must be true: DAT uses a constant learning rate
    clf_indist_weight: float = 0.5  # energy-BCE weight of the in-dist term (weights normalised to sum 1)
    clf_outdist_weight: float = 0.0  # energy-BCE weight of clean out-dist images (costs a forward)
    clf_adv_weight: float = 0.5  # energy-BCE weight of the PGD negatives
    r1_indist_weight: float = 1.0  # original field, unused (R1 acts on x_in)
    r1_outdist_weight: float = 0.0  # original field, unused
    r1_adv_weight: float = 0.0  # original field, unused
    xent_indist_weight: Optional[float] = None  # older spelling of clf_indist_weight
    xent_outdist_weight: Optional[float] = None  # older spelling of clf_outdist_weight
    xent_adv_weight: Optional[float] = None  # older spelling of clf_adv_weight

    # Schedule
    batch_size: int = 128  # GLOBAL images per optimizer step, whatever the world size
    per_device_batch_size: Optional[int] = None  # micro-batch; default batch_size / world_size
    min_imgs_per_threshold: int = 10000  # curriculum window = ceil(this / batch_size) steps
    AUC_th: float = 0.8  # T advances when the window's mean adversarial AUC reaches this
    samples_per_attack_step: Optional[int] = None  # instead: advance T after this many images
    rand_seed: int = 0  # seeds weights, shuffles, augmentations and attack noise
    total_epochs: Optional[int] = None  # stop after this many epochs of the in-dist stream
    max_steps: Optional[int] = None  # stop after this many optimizer steps

    # Intervals, in images
    n_imgs_per_metrics_log: int = 12800  # metrics.jsonl / wandb record
    n_imgs_per_image_log: int = 128000  # PNG grid of training negatives
    n_imgs_per_evaluation_log: Optional[int] = None  # accuracy, robust accuracy, samples, FID
    n_imgs_per_ckpt_save: int = 256000  # full training state in <run_dir>/checkpoints

    # Model averaging / precision
    use_ema: bool = True  # keep an EMA of the weights; evaluate and export it
    ema_decay: float = 0.999  # EMA decay (warmed up from 0)
    amp: str = "none"  # none, bf16 or fp16 (with GradScaler)
    fp16: bool = False  # original flag; same as amp=fp16

    # Method switches
    logsumexp: bool = True  # energy s(x) = logsumexp_k f_k(x); false: f_y(x)
    logsumexp_sampling: bool = False  # negatives ascend logsumexp instead of f_y
    augm_type_classification: str = "autoaugment_cutout"  # augmentation of the classifier stream
    augm_type_generation: str = "original"  # augmentation of the EBM in-dist and out-dist streams
    tinyimages_loader: str = "innout"  # original field, unused
    robust_eval: bool = True  # evaluate robust accuracy (PGD with indist_attack_clf)
    robust_eval_steps: Optional[int] = None  # PGD steps of robust evaluation (default: K)
    per_device_eval_batch_size: Optional[int] = None  # eval images per rank and batch; default min(batch_size, 3 x micro-batch)

    # Accepted from the original, unused here (reported once, see IGNORED_FIELDS)
    indist_clean_extra: bool = False  # original field, unused
    indist_perturb: bool = False  # original field, unused
    indist_perturb_steps: int = 10  # original field, unused
    indist_perturb_eps: float = 0.5  # original field, unused
    mixup_alpha: float = 5  # original field, unused
    mixup_beta: float = 1  # original field, unused
    indist_train_only: bool = False  # original field, unused
    eval_only: bool = False  # original field, unused (use python -m rebm.eval.evaluate)
    use_counterfactuals: bool = False  # original field, unused
    evaluate_ood_detection: bool = False  # original field, unused (rebm.eval.evaluate --ood)
    ood_detection_logsumexp: bool = False  # original field, unused
    outdist_dataset_ood_detection: str = "noise"  # original field, unused
    openimages_max_samples: Optional[int] = None  # original field, unused
    openimages_augm: Optional[str] = None  # original field, unused
    config_path: Optional[str] = None  # original field, unused

    # Tracking
    wandb_project: str = "rebm"  # wandb project
    wandb_dir: Optional[str] = None  # wandb files (default: the run directory)
    wandb_disabled: bool = False  # original switch; same as wandb_mode=disabled
    wandb_mode: str = "auto"  # auto (online with an API key, else offline), online, offline, disabled
    tags: List[str] = field(default_factory=list)  # wandb tags

    # Run directory, resume
    run_dir: Optional[str] = None  # output directory (default runs/<time>); holds the states
    resume_from_state: Optional[str] = None  # a state file (or run dir) to resume from
    resume_path: Optional[str] = None  # original spelling of resume_from_state
    resume: str = "auto"  # auto: resume from the newest state in run_dir; never: refuse a run_dir with states
    keep_last_states: int = 3  # training states kept in <run_dir>/checkpoints

    # Distributed
    use_ddp: bool = True  # DDP under a multi-process launcher; false + 1 process: DataParallel
    ddp_backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU), nccl or gloo
    device: str = "auto"  # auto, cpu or cuda (cuda:LOCAL_RANK)
    sync_batchnorm: bool = False  # SyncBatchNorm under DDP (only with use_batchnorm)
    find_unused_parameters: bool = False  # DDP option, for models with unused parameters
    ddp_timeout_s: float = 1800.0  # collective timeout during start-up (data, compile)
    ddp_step_timeout_s: float = 180.0  # collective timeout after step 1, so a stuck rank surfaces


# Fields the original accepted but this implementation does not use. Setting one to a
# non-default value is reported once (not an error, so old experiment files keep loading).
IGNORED_FIELDS = {
    "attack.fixed_steps",
    "attack.lr",
    "indist_attack_clf.fixed_steps",
    "indist_attack_clf.lr",
    "model.use_layernorm",
    "model.model_prefix",
    "model.drop_path_rate",
    "model.head_init_scale",
    "model.model_id",
    "model.use_convstem",
    "model.which_logit",
    "data.mixed_id",
    "image_log.attack_type",
    "image_log.ood_data_dir",
    "image_log.img_extension",
    "image_log.save_dir",
    "image_log.target_class",
    "image_log.adaptive_steps",
    "image_log.step_sweep_range",
    "image_log.sweep_num_samples",
    "image_log.lr",
    "r1_outdist_weight",
    "r1_adv_weight",
    "r1_indist_weight",
    "tinyimages_loader",
    "indist_clean_extra",
    "indist_perturb",
    "indist_perturb_steps",
    "indist_perturb_eps",
    "mixup_alpha",
    "mixup_beta",
    "indist_train_only",
    "eval_only",
    "use_counterfactuals",
    "evaluate_ood_detection",
    "ood_detection_logsumexp",
    "outdist_dataset_ood_detection",
    "openimages_max_samples",
    "openimages_augm",
    "config_path",
}


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------
def _all_keys(obj: Any, prefix: str = "") -> List[str]:
    keys = []
    for f in fields(obj):
        keys.append(prefix + f.name)
        value = getattr(obj, f.name)
        if is_dataclass(value):
            keys.extend(_all_keys(value, prefix + f.name + "."))
    return keys


VALID_KEYS = _all_keys(TrainConfig())


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, VALID_KEYS, n=1, cutoff=0.5)
    if not close:
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in VALID_KEYS if k.rsplit(".", 1)[-1].lower() == leaf.lower()]
    return f" Did you mean '{close[0]}'?" if close else ""


def _translate(err: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or "?"
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


def _merge(base: DictConfig, other: Any, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        raise _translate(err, source) from None


def _explicit_keys(container: Any, prefix: str = "") -> List[str]:
    out = []
    if isinstance(container, dict):
        for k, v in container.items():
            name = f"{prefix}{k}"
            out.append(name)
            out.extend(_explicit_keys(v, name + "."))
    return out


def load_config(path: Optional[str], overrides: Sequence[str] = ()) -> TrainConfig:
    """YAML file + dot-list overrides -> validated TrainConfig (raises ConfigError)."""
    schema = OmegaConf.structured(TrainConfig)
    explicit: List[str] = []
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file '{path}' does not exist; pass the path of a YAML file")
        try:
            loaded = OmegaConf.load(path)
        except Exception as err:  # yaml.YAMLError and friends
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(f"{path}: not valid YAML ({first})") from None
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"{path}: the top level of a config must be a mapping of keys")
        explicit += _explicit_keys(OmegaConf.to_container(loaded))
        schema = _merge(schema, loaded, path)
    overrides = list(overrides)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key=value (e.g. lr=0.01)")
    if overrides:
        try:
            dotlist = OmegaConf.from_dotlist(overrides)
        except OmegaConfBaseException as err:
            raise ConfigError(f"command line: cannot parse overrides: {err}") from None
        explicit += _explicit_keys(OmegaConf.to_container(dotlist))
        schema = _merge(schema, dotlist, "command line")
    try:
        cfg: TrainConfig = OmegaConf.to_object(schema)  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        raise _translate(err, path or "command line") from None
    validate(cfg, source=path or "command line")
    cfg._explicit_keys = sorted(set(explicit))  # type: ignore[attr-defined]
    return cfg


def ignored_fields_set(cfg: TrainConfig) -> List[str]:
    """Ignored fields the user set explicitly (to report once at start-up)."""
    return [k for k in getattr(cfg, "_explicit_keys", []) if k in IGNORED_FIELDS]


def _check_choice(value: str, choices: Sequence[str], key: str, source: str) -> None:
    if value not in choices:
        raise ConfigError(
            f"{source}: '{key}: {value}' is not a valid choice; use one of {', '.join(choices)}"
        )


def validate(cfg: TrainConfig, source: str = "config") -> None:
    """Checks that need no world size; raises ConfigError naming the key."""
    from rebm.models import MODEL_NAMES  # local import: models import nothing from training

    _check_choice(cfg.data.indist_dataset, INDIST_DATASETS, "data.indist_dataset", source)
    _check_choice(cfg.data.outdist_dataset, OUTDIST_DATASETS, "data.outdist_dataset", source)
    _check_choice(cfg.optimizer.lower(), OPTIMIZERS, "optimizer", source)
    _check_choice(cfg.amp, AMP_MODES, "amp", source)
    _check_choice(cfg.wandb_mode, WANDB_MODES, "wandb_mode", source)
    _check_choice(cfg.ddp_backend, DDP_BACKENDS, "ddp_backend", source)
    _check_choice(cfg.device, DEVICES, "device", source)
    _check_choice(cfg.resume, RESUME_MODES, "resume", source)
    _check_choice(cfg.model.which_logit, WHICH_LOGIT, "model.which_logit", source)
    _check_choice(cfg.augm_type_generation, AUGMENTATIONS, "augm_type_generation", source)
    _check_choice(
        cfg.augm_type_classification, AUGMENTATIONS, "augm_type_classification", source
    )
    _check_choice(cfg.model.model_type, MODEL_NAMES, "model.model_type", source)
    for name in ("attack", "indist_attack_clf"):
        attack: AttackConfig = getattr(cfg, name)
        _check_choice(attack.attack_type, ATTACK_TYPES, f"{name}.attack_type", source)
        _check_choice(attack.norm, NORMS, f"{name}.norm", source)
        if attack.step_size < 0:
            raise ConfigError(f"{source}: '{name}.step_size' must be >= 0, got {attack.step_size}")
        if not attack.eps > 0:
            raise ConfigError(f"{source}: '{name}.eps' must be > 0 (or .inf), got {attack.eps}")
        if attack.max_steps < 0 or attack.start_step < 0:
            raise ConfigError(f"{source}: '{name}.max_steps'/'start_step' must be >= 0")
    if cfg.attack.start_step > cfg.attack.max_steps:
        raise ConfigError(
            f"{source}: 'attack.start_step' ({cfg.attack.start_step}) exceeds "
            f"'attack.max_steps' ({cfg.attack.max_steps})"
        )
    if cfg.image_log.step_size < 0 or cfg.image_log.num_steps < 0:
        raise ConfigError(f"{source}: 'image_log.step_size' and 'image_log.num_steps' must be >= 0")
    if not cfg.image_log.eps > 0:
        raise ConfigError(f"{source}: 'image_log.eps' must be > 0 (or .inf)")
    if cfg.robust_eval_steps is not None and cfg.robust_eval_steps < 0:
        raise ConfigError(f"{source}: 'robust_eval_steps' must be >= 0 or null")
    for key in ("batch_size", "min_imgs_per_threshold", "n_imgs_per_metrics_log",
                "n_imgs_per_image_log", "n_imgs_per_ckpt_save", "keep_last_states"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"{source}: '{key}' must be a positive integer, got {getattr(cfg, key)}")
    for key in ("per_device_batch_size", "per_device_eval_batch_size", "max_steps",
                "total_epochs", "samples_per_attack_step", "n_imgs_per_evaluation_log"):
        value = getattr(cfg, key)
        if value is not None and value <= 0:
            raise ConfigError(f"{source}: '{key}' must be positive or null, got {value}")
    if cfg.lr <= 0:
        raise ConfigError(f"{source}: 'lr' must be > 0, got {cfg.lr}")
    if not 0 <= cfg.ema_decay < 1:
        raise ConfigError(f"{source}: 'ema_decay' must be in [0, 1), got {cfg.ema_decay}")
    if not cfg.fixed_lr:
        raise ConfigError(
            f"{source}: 'fixed_lr: false' is not supported (DAT uses a constant learning rate); "
            "set fixed_lr: true"
        )
    if cfg.data.num_workers < 0:
        raise ConfigError(f"{source}: 'data.num_workers' must be >= 0")
    if cfg.fp16 and cfg.amp == "none":
        cfg.amp = "fp16"
    weights = loss_weights(cfg)
    if min(weights) < 0 or sum(weights) <= 0:
        raise ConfigError(
            f"{source}: 'clf_indist_weight', 'clf_outdist_weight', 'clf_adv_weight' must be >= 0 "
            "with a positive sum"
        )
    if cfg.resume_path and not cfg.resume_from_state:
        cfg.resume_from_state = cfg.resume_path


def loss_weights(cfg: TrainConfig) -> tuple:
    """(in-dist, clean out-dist, adversarial out-dist) weights of the energy BCE, normalised."""
    raw = [
        cfg.xent_indist_weight if cfg.xent_indist_weight is not None else cfg.clf_indist_weight,
        cfg.xent_outdist_weight if cfg.xent_outdist_weight is not None else cfg.clf_outdist_weight,
        cfg.xent_adv_weight if cfg.xent_adv_weight is not None else cfg.clf_adv_weight,
    ]
    total = sum(raw)
    return tuple(w / total for w in raw) if total > 0 else tuple(raw)


@dataclass(frozen=True)
class BatchPlan:
    """How the global batch is split: batch_size = per_device * accumulation * world_size."""

    global_batch_size: int
    per_device_batch_size: int
    accumulation_steps: int
    world_size: int


def plan_batches(cfg: TrainConfig, world_size: int) -> BatchPlan:
    if cfg.batch_size % world_size:
        raise ConfigError(
            f"batch_size {cfg.batch_size} is not divisible by the world size {world_size}; "
            f"choose a batch_size that is a multiple of {world_size}"
        )
    per_device = cfg.per_device_batch_size or cfg.batch_size // world_size
    if cfg.batch_size % (per_device * world_size):
        raise ConfigError(
            f"batch_size {cfg.batch_size} is not divisible by per_device_batch_size "
            f"{per_device} x world size {world_size}; choose per_device_batch_size dividing "
            f"{cfg.batch_size // world_size}"
        )
    return BatchPlan(
        global_batch_size=cfg.batch_size,
        per_device_batch_size=per_device,
        accumulation_steps=cfg.batch_size // (per_device * world_size),
        world_size=world_size,
    )


def to_yaml(cfg: TrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: TrainConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))  # type: ignore[return-value]
