"""Typed experiment configuration: the sections and fields rebm reads (docs/design.md §2).

One YAML file is one experiment. It is merged onto the dataclasses below (field names are those of
the original DAT configs, so existing experiment files load unchanged; fields the original had but
rebm does not use are in legacy.py), then `key=value` / `a.b=value` overrides from the command line
(OmegaConf dot-list) are applied on top (loading.py); the original's other spellings of some
fields are aliases (rebm/compat/aliases.py). The trailing comment of each field is its
documentation (docs/configs.md is generated from it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Union

from rebm.compat.config_fields import (
    LegacyAttackFields,
    LegacyDataFields,
    LegacyImageLogFields,
    LegacyModelFields,
    LegacyTrainFields,
)
from rebm.config.evaluation import EvalConfig
from rebm.config.frozen import Frozen
from rebm.config.optimizers import OptimizerSection
from rebm.config.sections import (
    DistributedSection,
    EmaSection,
    EvaluationSection,
    InputSection,
    IntervalSection,
    LoggingSection,
    MethodSection,
    RunSection,
    ScheduleSection,
    gather,
)

# Choices (validated by hand: OmegaConf does not check typing.Literal). Datasets and optimizers
# are registries (rebm/config/datasets.py, rebm/config/optimizers.py), models too (rebm.models).
AUGMENTATIONS = (
    "original",
    "autoaugment_cutout",
    "none",
    "test",
    # ImageNet (take an image of any size to data.image_size; docs/data.md)
    "madry",
    "default",
    "generation_id",
    "generation_id_randomcrop",
    "generation_od",
    "generation_od_randomcrop",
)
ATTACK_TYPES = ("pgd", "argmin_pgd")  # argmin_pgd: indist_attack_clf only (rebm/attacks/argmin_pgd.py)
NORMS = ("L2", "Linf")
AMP_MODES = ("none", "bf16", "fp16")
WANDB_MODES = ("auto", "online", "offline", "disabled")
DDP_BACKENDS = ("auto", "nccl", "gloo")
DEVICES = ("auto", "cpu", "cuda")
RESUME_MODES = ("auto", "never", "force")
WHICH_LOGIT = ("first", "all", "bird")
# image_log.seed_images values that are not paths
SEED_NOISES = ("noise", "lowfreq-noise", "gaussian")


@dataclass
class AttackConfig(LegacyAttackFields, Frozen):
    """PGD threat model. `attack` = negatives (generation), `indist_attack_clf` = adversarial
    training of the classifier."""

    attack_type: str = "pgd"  # pgd, or for indist_attack_clf argmin_pgd: In-N-Out's momentum PGD keeping the best iterate (stage 1's configs; the original's adam attack is not supported)
    max_steps: int = 0  # attack: curriculum cap on T; indist_attack_clf: PGD steps K
    start_step: int = 0  # attack: T at the start of training
    step_size: float = 0.1  # alpha: L2 normalised-gradient step length (Linf: sign step)
    eps: float = math.inf  # radius around the start point; .inf = only the [0, 1] clamp
    norm: str = "L2"  # L2 or Linf
    random_start: bool = False  # start at a random point of the eps-ball (seeded per sample)


@dataclass
class ImageLogConfig(LegacyImageLogFields, Frozen):
    """Class-conditional sample generation (images and FID)."""

    num_steps: int = 20  # PGD steps from the seed images
    log_fid: bool = False  # compute FID of the samples against data_dir (see docs/evaluation.md)
    data_dir: Optional[str] = None  # FID reference statistics (.npz with mu, sigma; python -m rebm.eval.fid_stats)
    inception_weights: Optional[str] = None  # FID Inception weights file; default: the FID library's cache
    unverified_inception: bool = False  # true: accept Inception weights that are not the pinned file (sha256 6726825d...); FID, IS and precision/recall then go under *_unverified keys
    num_samples: int = 100  # samples per evaluation, labels balanced over the classes
    step_size: float = 0.1  # PGD step length of generation
    eps: float = math.inf  # PGD radius of generation
    norm: str = "L2"  # L2 (normalised-gradient steps) or Linf (sign steps) for generation
    adaptive_steps: bool = False  # pick num_steps by FID over a sweep before each FID evaluation
    step_sweep_range: Optional[List[int]] = None  # step counts the sweep tries (default: see sweep_radius)
    sweep_radius: int = 3  # without step_sweep_range: try num_steps - r ... num_steps + r (the original's default 3)
    sweep_num_samples: int = 500  # samples per candidate of the sweep
    blur_kernel_size: int = 0  # Gaussian blur kernel of the seed images (odd size; 0 = none), applied only with blur_fid_seeds (the original reads it nowhere but in a code path that asserts it is 0)
    adaptive_blur: bool = False  # with blur_fid_seeds: scale blur_kernel_size with data.image_size / 32 (the original reads it nowhere)
    blur_fid_seeds: bool = False  # rebm's option: blur the evaluation samples' seeds (FID, IS, P-R, grid) by blur_kernel_size / adaptive_blur; the original's compute_fid never blurs them
    seed_images: str = "noise"  # generation starts from: noise, lowfreq-noise, gaussian (fitted to the data), a .pt/.npz file or a folder


@dataclass
class DataConfig(LegacyDataFields, Frozen):
    indist_dataset: str = "cifar10-conditional"  # a dataset of rebm/data/sets: cifar10(-conditional), cifar100(-conditional), digits, imagefolder, ImageNet
    indist_ds_dir: str = "./data"  # dataset root (torchvision layout; imagefolder: train/ and test/; ImageNet: meta.bin, train/, val/)
    outdist_dataset: str = "noise"  # a dataset of rebm/data/sets: tinyimages, imagefolder, OpenImageO, tensorfile, noise/uniform-noise, lowfreq-noise
    outdist_std_dir: str = "./data"  # folder of tiny_images.bin / image folder (also OpenImageO) / tensor file path
    num_workers: int = 2  # loader workers per process, which also decode the JPEGs (capped by the cores per process)
    num_classes: int = 10  # classes of the in-distribution (unset: the dataset's, e.g. 100 for cifar100, 1000 for ImageNet)
    image_size: int = 32  # side of the images fed to the model and of the samples (ImageNet: 256 unless set, the original's default)
    download: bool = False  # let torchvision download CIFAR if it is missing
    tinyimages_exclusion_dir: Optional[str] = "./data/TinyImagesExclusionIdcs"  # TinyImages: folder of the original's six exclusion lists (a copy of its InNOutRobustness/TinyImagesExclusionIdcs; 200,470 records, mostly CIFAR near-duplicates); null: exclude none of them
    outdist_exclude_index: Optional[str] = None  # TinyImages: file of 0-based record indices to skip, besides the lists of tinyimages_exclusion_dir
    cutout_size: Optional[int] = None  # side of autoaugment_cutout's Cutout square in px; unset: image_size // 2 (16 at 32; In-N-Out's CIFAR-100 uses 8)


@dataclass
class ModelConfig(LegacyModelFields, Frozen):
    model_type: str = "WideResNet34x10"  # one of rebm.models.MODEL_NAMES (docs/imagenet.md lists the ImageNet ones)
    ckpt_path: Optional[str] = None  # weights to start from (any format load_checkpoint reads)
    trust_checkpoint: bool = False  # also unpickle Python objects outside rebm's allow-list from ckpt_path (they can run code): only for files you trust
    normalize_input: bool = True  # normalise inputs inside the model (statistics of data.indist_dataset: CIFAR-10's, ImageNet's)
    use_batchnorm: bool = False  # false: BatchNorm frozen in eval mode while training (DAT stage 2)
    use_convstem: bool = False  # ConvNeXt: the convolutional stem of Singh et al. instead of timm's patch stem (their robust checkpoints need it); unset: true for ConvNeXt, the original's default
    use_layernorm: bool = True  # ConvNeXt: the original's switch; LayerNorm is the same in train and eval mode, so it changes nothing
    channels_last: Union[bool, str] = "auto"  # channels_last memory format: true, false or auto (on for CPU and for CUDA with amp bf16/fp16; see docs/performance.md)
    compile: Union[bool, str] = "auto"  # torch.compile the model (before DDP wrapping): true, false or auto (on when the planned run is long enough to repay the compilation; the start-up line says why; see docs/performance.md)


@dataclass
class TrainConfig(LegacyTrainFields, Frozen):
    data: DataConfig = field(default_factory=DataConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    indist_attack_clf: AttackConfig = field(
        default_factory=lambda: AttackConfig(max_steps=10, step_size=0.1, eps=0.5)
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    image_log: ImageLogConfig = field(default_factory=ImageLogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # how models are evaluated (rebm/config/evaluation.py)

    # Optimisation
    optimizer: str = "sgd"  # a name of rebm/engine/optimizers.py: sgd (momentum 0.9, nesterov), adam (betas 0, 0.99), adamw (0.9, 0.95)
    lr: float = 1e-3  # learning rate (stage 1: where its schedule starts)
    wd: float = 5e-4  # weight decay
    r1reg: float = 0.0  # weight of 1/2 mean ||grad_x s(x_in)||^2
    max_grad_norm: Optional[float] = None  # clip the gradients' total norm to this before each optimizer step, logged as grad_norm (null: no clipping)
    fixed_lr: bool = True  # stage 2: must be true (DAT uses a constant learning rate, as the original requires); stage 1 does not read it
    lr_schedule: Optional[str] = None  # cosine (to 0 over the run) or constant; null: the stage's default, stage 1 cosine (the In-N-Out recipe), stage 2 constant (the only one it offers)
    clf_indist_weight: float = 0.5  # energy-BCE weight of the in-dist term (weights normalised to sum 1)
    clf_outdist_weight: float = 0.0  # energy-BCE weight of clean out-dist images (costs a forward)
    clf_adv_weight: float = 0.5  # energy-BCE weight of the PGD negatives
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
    use_ema: bool = False  # keep an EMA of the weights; evaluate and export it (the original's default is false)
    ema_decay: float = 0.999  # EMA decay, reached by the original's warm-up: min(ema_decay, (1 + n) / (10 + n)) at the n-th average
    amp: str = "none"  # none, bf16 or fp16 (with GradScaler)
    fuse_attacks: Union[bool, str] = "auto"  # DAT: run the negatives' and the classifier batch's PGD as one batched pass while both run: true, false or auto (see docs/performance.md)

    # Method switches
    logsumexp: bool = True  # energy s(x) = logsumexp_k f_k(x); false: f_y(x)
    logsumexp_sampling: bool = False  # negatives ascend logsumexp instead of f_y
    augm_type_classification: str = "autoaugment_cutout"  # augmentation of the classifier stream
    augm_type_generation: str = "original"  # augmentation of the EBM in-dist and out-dist streams
    openimages_max_samples: Optional[int] = None  # OpenImageO: use the fixed subset randperm(n, seed 42)[:this] of the folder (null: all)
    openimages_augm: Optional[str] = None  # OpenImageO augmentation; null: generation_od (generation_od_randomcrop with generation_id_randomcrop)
    track_r1: bool = False  # log 1/2 mean ||grad_x s(x_in)||^2 (train_r1_loss, unweighted, on metrics-log steps) without training on it
    keep_samples: bool = False  # also write every generated sample as a PNG under samples/step_<N>/
    robust_eval: bool = True  # evaluate robust accuracy (PGD with indist_attack_clf)
    robust_eval_steps: Optional[int] = None  # PGD steps of robust evaluation (default: K)
    per_device_eval_batch_size: Optional[int] = None  # eval images per rank and batch; default min(batch_size, 3 x micro-batch)


    # Tracking
    wandb_project: str = "rebm"  # wandb project
    wandb_dir: Optional[str] = None  # wandb files (default: the run directory)
    wandb_disabled: bool = False  # original switch; same as wandb_mode=disabled
    wandb_mode: str = "auto"  # auto (online with an API key, else offline), online, offline, disabled
    tags: List[str] = field(default_factory=list)  # wandb tags

    # Run directory, resume
    run_dir: Optional[str] = None  # output directory; default runs/<config folder>/<config name>[-<hash of training overrides>]
    resume_from_state: Optional[str] = None  # a state file (or run dir) to resume from
    resume: str = "auto"  # auto: continue from the newest state in run_dir (same training config); force: even if the config changed; never: refuse a run_dir with states
    keep_last_states: int = 3  # training states kept in <run_dir>/checkpoints

    # Distributed
    use_ddp: bool = True  # DDP under a multi-process launcher; false + 1 process: DataParallel
    ddp_backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU), nccl or gloo
    device: str = "auto"  # auto, cpu or cuda (cuda:LOCAL_RANK)
    sync_batchnorm: bool = False  # SyncBatchNorm under DDP (only with use_batchnorm)
    find_unused_parameters: bool = False  # DDP option, for models with unused parameters
    ddp_timeout_s: float = 1800.0  # collective timeout during start-up (data, compile)
    ddp_step_timeout_s: float = 180.0  # collective timeout after step 1, so a stuck rank surfaces

    # The sections of the top-level keys (rebm/config/sections.py): what components take.
    @property
    def optimization(self) -> OptimizerSection:
        return OptimizerSection(name=self.optimizer, lr=self.lr, wd=self.wd)

    @property
    def inputs(self) -> InputSection:
        return gather(InputSection, self)

    @property
    def schedule(self) -> ScheduleSection:
        return gather(ScheduleSection, self)

    @property
    def intervals(self) -> IntervalSection:
        return gather(IntervalSection, self)

    @property
    def method(self) -> MethodSection:
        return gather(MethodSection, self)

    @property
    def ema(self) -> EmaSection:
        return gather(EmaSection, self)

    @property
    def evaluation(self) -> EvaluationSection:
        return gather(EvaluationSection, self)

    @property
    def run(self) -> RunSection:
        return gather(RunSection, self)

    @property
    def logging(self) -> LoggingSection:
        return gather(LoggingSection, self)

    @property
    def distributed(self) -> DistributedSection:
        return gather(DistributedSection, self)

