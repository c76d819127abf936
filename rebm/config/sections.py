"""The sections of a config that are not nested in its file: what each component of a run reads
(docs/design.md §2).

`TrainConfig` (schema.py) stores sections, each key declared once, in the section that owns it,
as torchtitan's JobConfig does; a component takes the section it reads (`cfg.schedule`,
`cfg.run`, ...). The YAML keeps the original's layout, most keys at the top level, so the
original's experiment files load unchanged: rebm/config/layout.py maps each top-level key of a
file to its section. The trailing comment of each field is its documentation (docs/configs.md
is generated from it). Importing this module imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Union

from rebm.compat.config_fields import LegacyAttackFields
from rebm.config.frozen import Frozen


@dataclass
class ScheduleSection(Frozen):
    """How long a run is, its batches, the seed that orders them, and its learning rate over
    the steps."""

    fixed_lr: bool = True  # stage 2: must be true (DAT uses a constant learning rate, as the original requires); stage 1 does not read it
    lr_schedule: Optional[str] = None  # cosine (to 0 over the run) or constant; null: the stage's default, stage 1 cosine (the In-N-Out recipe), stage 2 constant (the only one it offers)
    batch_size: int = 128  # GLOBAL images per optimizer step, whatever the world size
    per_device_batch_size: Optional[int] = None  # micro-batch; default batch_size / world_size
    rand_seed: int = 0  # seeds weights, shuffles, augmentations and attack noise
    total_epochs: Optional[int] = None  # stop after this many epochs of the in-dist stream
    max_steps: Optional[int] = None  # stop after this many optimizer steps


@dataclass
class IntervalSection(Frozen):
    """Every how many images a run logs, evaluates and saves its state."""

    n_imgs_per_metrics_log: int = 12800  # metrics.jsonl / wandb record
    n_imgs_per_image_log: int = 128000  # PNG grid of training negatives
    n_imgs_per_evaluation_log: Optional[int] = None  # accuracy, robust accuracy, samples, FID
    n_imgs_per_ckpt_save: int = 256000  # full training state in <run_dir>/checkpoints


@dataclass
class EmaSection(Frozen):
    """The moving average of the weights."""

    use_ema: bool = False  # keep an EMA of the weights; evaluate and export it (the original's default is false)
    ema_decay: float = 0.999  # EMA decay, reached by the original's warm-up: min(ema_decay, (1 + n) / (10 + n)) at the n-th average


@dataclass
class RunSection(Frozen):
    """The run directory: where it is, resuming, how many training states it keeps."""

    run_dir: Optional[str] = None  # output directory; default runs/<config folder>/<config name>[-<hash of training overrides>]
    resume_from_state: Optional[str] = None  # a state file (or run dir) to resume from
    resume: str = "auto"  # auto: continue from the newest state in run_dir (same training config); force: even if the config changed; never: refuse a run_dir with states
    keep_last_states: int = 3  # training states kept in <run_dir>/checkpoints


@dataclass
class LoggingSection(Frozen):
    """Tracking: wandb's project, folder, mode and tags; the console's progress lines."""

    wandb_project: str = "rebm"  # wandb project
    wandb_dir: Optional[str] = None  # wandb files (default: the run directory)
    wandb_disabled: bool = False  # original switch; same as wandb_mode=disabled
    wandb_mode: str = "auto"  # auto (online with an API key, else offline), online, offline, disabled
    tags: List[str] = field(default_factory=list)  # wandb tags
    progress_interval_s: Optional[float] = 60.0  # without a progress bar (output to a file or pipe): a line every this many seconds with the steps done, images/s and when the next metrics log, evaluation, state save and the end come; null or 0: none


@dataclass
class DistributedSection(Frozen):
    """The hardware a run computes on: its processes, device, backend, DDP's options, the
    collectives' timeouts and the precision."""

    amp: str = "none"  # none, bf16 or fp16 (with GradScaler)
    use_ddp: bool = True  # DDP under a multi-process launcher; false + 1 process: DataParallel
    ddp_backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU), nccl or gloo
    device: str = "auto"  # auto, cpu or cuda (cuda:LOCAL_RANK)
    sync_batchnorm: bool = False  # SyncBatchNorm under DDP (only with use_batchnorm)
    find_unused_parameters: bool = False  # DDP option, for models with unused parameters
    ddp_timeout_s: float = 1800.0  # collective timeout during start-up (data, compile)
    ddp_step_timeout_s: float = 180.0  # collective timeout after step 1, so a stuck rank surfaces


@dataclass
class AttackConfig(LegacyAttackFields, Frozen):
    """PGD threat model. `attack` = negatives (generation), `indist_attack_clf` = adversarial
    training of the classifier."""

    attack_type: str = "pgd"  # pgd, or for indist_attack_clf argmin_pgd: In-N-Out's momentum PGD keeping the best iterate (stage 1's configs; the original's adam attack is not supported)
    max_steps: int = 0  # attack: curriculum cap on T; indist_attack_clf: PGD steps K
    start_step: int = 0  # attack: T at the start of training; indist_attack_clf: without effect (the original only asserts it equals max_steps)
    step_size: float = 0.1  # alpha: L2 normalised-gradient step length (Linf: sign step)
    eps: float = math.inf  # radius around the start point; .inf = only the [0, 1] clamp
    norm: str = "L2"  # L2 or Linf
    random_start: bool = False  # start at a random point of the eps-ball (seeded per sample)


@dataclass
class MethodSection(Frozen):
    """The training method's keys: its two attacks, the loss weights, the energies and the
    curriculum."""

    attack: AttackConfig = field(default_factory=AttackConfig)  # the negatives' PGD (T)
    indist_attack_clf: AttackConfig = field(
        default_factory=lambda: AttackConfig(max_steps=10, step_size=0.1, eps=0.5)
    )  # the classifier batch's PGD (K)
    r1reg: float = 0.0  # weight of 1/2 mean ||grad_x s(x_in)||^2
    clf_indist_weight: float = 0.5  # energy-BCE weight of the in-dist term (weights normalised to sum 1)
    clf_outdist_weight: float = 0.0  # energy-BCE weight of clean out-dist images (costs a forward)
    clf_adv_weight: float = 0.5  # energy-BCE weight of the PGD negatives
    xent_indist_weight: Optional[float] = None  # older spelling of clf_indist_weight
    xent_outdist_weight: Optional[float] = None  # older spelling of clf_outdist_weight
    xent_adv_weight: Optional[float] = None  # older spelling of clf_adv_weight
    min_imgs_per_threshold: int = 10000  # curriculum window = ceil(this / batch_size) steps
    AUC_th: float = 0.8  # T advances when the window's mean adversarial AUC reaches this
    samples_per_attack_step: Optional[int] = None  # instead: advance T after this many images
    fuse_attacks: Union[bool, str] = "auto"  # DAT: run the negatives' and the classifier batch's PGD as one batched pass while both run: true, false or auto (see docs/performance.md)
    logsumexp: bool = True  # energy s(x) = logsumexp_k f_k(x); false: f_y(x)
    logsumexp_sampling: bool = False  # negatives ascend logsumexp instead of f_y
    track_r1: bool = False  # log 1/2 mean ||grad_x s(x_in)||^2 (train_r1_loss, unweighted, on metrics-log steps) without training on it


