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
    IntervalSection,
    LoggingSection,
    MethodSection,
    RunSection,
    ScheduleSection,
)
from rebm.config.views import EvaluationSection, InputSection, NetworkSection

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
    augm_type_classification: str = "autoaugment_cutout"  # augmentation of the classifier stream
    augm_type_generation: str = "original"  # augmentation of the EBM in-dist and out-dist streams
    openimages_max_samples: Optional[int] = None  # OpenImageO: use the fixed subset randperm(n, seed 42)[:this] of the folder (null: all)
    openimages_augm: Optional[str] = None  # OpenImageO augmentation; null: generation_od (generation_od_randomcrop with generation_id_randomcrop)


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
    """One experiment: its sections, each key declared once (the file's top-level keys map to
    them: rebm/config/layout.py)."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodSection = field(default_factory=MethodSection)
    optimization: OptimizerSection = field(default_factory=OptimizerSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    intervals: IntervalSection = field(default_factory=IntervalSection)
    ema: EmaSection = field(default_factory=EmaSection)
    image_log: ImageLogConfig = field(default_factory=ImageLogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # how models are evaluated (rebm/config/evaluation.py)
    logging: LoggingSection = field(default_factory=LoggingSection)
    run: RunSection = field(default_factory=RunSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)

    # Views: what a component reads of several sections (references to them, no keys of their
    # own; rebm/config/views.py)
    @property
    def inputs(self) -> InputSection:
        return InputSection(data=self.data, schedule=self.schedule)

    @property
    def network(self) -> NetworkSection:
        return NetworkSection(model=self.model, data=self.data, distributed=self.distributed)

    @property
    def evaluation(self) -> EvaluationSection:
        return EvaluationSection(eval=self.eval, image_log=self.image_log, data=self.data,
                                 model=self.model, method=self.method, schedule=self.schedule,
                                 ema=self.ema)
