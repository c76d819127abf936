"""Typed sections: what each component of a run reads of the config (docs/design.md §2).

The YAML keeps the original's layout (most keys at the top level, so the original's experiment
files load unchanged). Components do not take that whole config: each takes the section it reads,
built here by one property of TrainConfig (`cfg.schedule`, `cfg.run`, ...), as the optimizer's
builder takes `OptimizerSection`. A section is frozen and holds only the keys its readers use; a
key a component needs is added to its section, so the section shows what a component depends on.
`data`, `model`, `attack`, `indist_attack_clf`, `image_log` and `eval` are sections already
(nested in the YAML); the sections below gather the top-level keys by concern. Importing this
module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, List, Optional, Type, TypeVar, Union

S = TypeVar("S")


def gather(section: Type[S], cfg: Any) -> S:
    """The section `section` of `cfg`: each of its fields read from the config's key of that name."""
    return section(**{f.name: getattr(cfg, f.name) for f in fields(section)})  # type: ignore[arg-type]


@dataclass(frozen=True)
class InputSection:
    """The training and evaluation data: the datasets, their augmentations, the seed."""

    data: Any  # DataConfig
    augm_type_classification: str
    augm_type_generation: str
    openimages_max_samples: Optional[int]
    openimages_augm: Optional[str]
    rand_seed: int
    batch_size: int


@dataclass(frozen=True)
class ScheduleSection:
    """How long a run is, its batches and its learning rate over the steps."""

    batch_size: int
    per_device_batch_size: Optional[int]
    total_epochs: Optional[int]
    max_steps: Optional[int]
    lr: float
    lr_schedule: Optional[str]
    fixed_lr: bool
    max_grad_norm: Optional[float]
    amp: str
    rand_seed: int


@dataclass(frozen=True)
class IntervalSection:
    """Every how many images a run logs, evaluates and saves its state."""

    n_imgs_per_metrics_log: int
    n_imgs_per_image_log: int
    n_imgs_per_evaluation_log: Optional[int]
    n_imgs_per_ckpt_save: int


@dataclass(frozen=True)
class MethodSection:
    """The training method's keys: loss weights, energies, attacks and the curriculum."""

    attack: Any  # AttackConfig: the negatives' PGD (T)
    indist_attack_clf: Any  # AttackConfig: the classifier batch's PGD (K)
    clf_indist_weight: float
    clf_outdist_weight: float
    clf_adv_weight: float
    xent_indist_weight: Optional[float]
    xent_outdist_weight: Optional[float]
    xent_adv_weight: Optional[float]
    r1reg: float
    track_r1: bool
    logsumexp: bool
    logsumexp_sampling: bool
    fuse_attacks: Union[bool, str]
    min_imgs_per_threshold: int
    samples_per_attack_step: Optional[int]
    AUC_th: float  # the curriculum's threshold on the window's mean AUC
    batch_size: int


@dataclass(frozen=True)
class EmaSection:
    """The moving average of the weights."""

    use_ema: bool
    ema_decay: float


@dataclass(frozen=True)
class EvaluationSection:
    """What an evaluation reads: its own section, generation, the data it tests on (and the
    inputs the out-distribution's loaders read), robust accuracy's attack, its batch, the energies
    the samples ascend and the seed."""

    eval: Any  # EvalConfig
    image_log: Any  # ImageLogConfig
    data: Any  # DataConfig
    indist_attack_clf: Any  # AttackConfig
    robust_eval: bool
    robust_eval_steps: Optional[int]
    per_device_eval_batch_size: Optional[int]
    batch_size: int  # with per_device_batch_size: the default evaluation batch (eval_batch_size)
    per_device_batch_size: Optional[int]
    inputs: InputSection  # the out-distribution's loaders (OOD detection's training out-dist)
    keep_samples: bool
    logsumexp: bool
    logsumexp_sampling: bool
    use_ema: bool
    rand_seed: int


@dataclass(frozen=True)
class RunSection:
    """The run directory: where it is, resuming, how many training states it keeps."""

    run_dir: Optional[str]
    resume_from_state: Optional[str]
    resume: str
    keep_last_states: int


@dataclass(frozen=True)
class LoggingSection:
    """Tracking: wandb's project, folder, mode and tags."""

    wandb_project: str
    wandb_dir: Optional[str]
    wandb_disabled: bool
    wandb_mode: str
    tags: List[str]


@dataclass(frozen=True)
class DistributedSection:
    """The processes: device, backend, DDP's options and the collectives' timeouts."""

    use_ddp: bool
    ddp_backend: str
    device: str
    sync_batchnorm: bool
    find_unused_parameters: bool
    ddp_timeout_s: float
    ddp_step_timeout_s: float
    amp: str
