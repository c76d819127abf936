"""What a shipped recipe needs to run on stand-in data: its stages (a CIFAR stage 2 starts from
the model of the stage-1 config whose run_dir it names), the size overrides of each stage, and
the stand-in files to write where the recipe reads them. Only sizes change: steps, images per
cadence, attack steps, samples, loader workers, and the model's width and depth within its
family (a WideResNet stays a WideResNet, a ResNet a ResNet, a ConvNeXt a ConvNeXt)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from rebm.config import ConfigError, TrainConfig, load_config

REPO = Path(__file__).resolve().parents[2]
TRAIN_AT = REPO / "InNOutRobustnessMean0_cifar100" / "train_at.py"
STAGE1_CONFIGS = REPO / "InNOutRobustnessMean0_cifar100" / "configs"
CIFAR = ("cifar10", "cifar10-conditional", "cifar100", "cifar100-conditional")
TINYIMAGES = ("tinyimages", "80m-tinyimages")

# The smallest member of each model family the recipes use (rebm/models): same code, less width
# and depth; the ImageNet families load the same public checkpoint layouts.
SMALL_MODELS = {"WideResNet": "WideResNet10x1", "ResNet50ImageNet": "TinyResNetImageNet",
                "WideResNet50x2ImageNet": "TinyResNetImageNet",
                "WideResNet50x4ImageNet": "TinyResNetImageNet", "convnext": "convnext_test"}
SIZES_CIFAR = {"batch_size": 32, "max_steps": 4, "indist_attack_clf.max_steps": 1,
               "data.num_workers": 0, "robust_eval_steps": 1, "n_imgs_per_metrics_log": 32,
               "n_imgs_per_evaluation_log": 64}
SIZES_IMAGENET = {"data.num_classes": 3, "data.image_size": 64, "data.num_workers": 0,
                  "batch_size": 8, "max_steps": 4, "indist_attack_clf.max_steps": 1,
                  "robust_eval_steps": 1, "n_imgs_per_metrics_log": 8,
                  "n_imgs_per_evaluation_log": 16, "openimages_max_samples": 10}
# Stage 2 besides: an AUC window of one step, a few samples of a few PGD steps, a state and a
# sample grid every 2 steps.
SIZES_DAT = {"image_log.num_samples": 20, "image_log.num_steps": 2,
             "image_log.sweep_num_samples": 20, "n_imgs_per_image_log": 2,
             "n_imgs_per_ckpt_save": 2, "min_imgs_per_threshold": 1}


@dataclass(frozen=True)
class Stage:
    """One training run of a recipe: stage 1 (train_at.py) or 2 (rebm.training.train)."""
    number: int
    config: Path
    run_dir: str  # relative to the stand-in folder
    overrides: Tuple[str, ...]  # the size overrides (and stage 2's run_dir)
    cfg: TrainConfig  # the config as the stand-in run loads it


@dataclass(frozen=True)
class Recipe:
    path: Path
    family: str  # 'cifar' or 'imagenet': which stand-in data it reads
    stages: Tuple[Stage, ...]
    original: TrainConfig  # the recipe unchanged, as a real run loads it

    @property
    def name(self) -> str:
        return self.path.stem


def shipped_recipes() -> List[Path]:
    """The shipped training recipes: experiments/ but the paper tables and the quickstart (which
    runs on real digits), and the stage-1 configs."""
    experiments = [p for p in (REPO / "experiments").rglob("*.yaml")
                   if p.parent.name in ("cifar10", "cifar100", "imagenet")]
    return sorted([*experiments, *STAGE1_CONFIGS.glob("*.yaml")])


def small_model(model_type: str) -> str:
    for family, small in SMALL_MODELS.items():
        if model_type.startswith(family):
            return small
    raise ConfigError(f"model.model_type '{model_type}': rebm.standin knows no smaller member of "
                      "its family; run the recipe as it is")


def size_overrides(cfg: TrainConfig, stage: int, family: str) -> Dict[str, object]:
    """{key: value} of the sizes this stage runs at, only those that differ from the recipe."""
    sizes: Dict[str, object] = dict(SIZES_CIFAR if family == "cifar" else SIZES_IMAGENET)
    sizes["model.model_type"] = small_model(cfg.model.model_type)
    batch = sizes["batch_size"]
    if stage == 2:
        sizes.update(SIZES_DAT)
        for key in ("n_imgs_per_image_log", "n_imgs_per_ckpt_save", "min_imgs_per_threshold"):
            sizes[key] = int(sizes[key]) * int(batch)  # in images: every N steps
    # a classifier attack that starts at step K begins at the smaller K
    if cfg.method.indist_attack_clf.start_step > int(sizes["indist_attack_clf.max_steps"]):
        sizes["indist_attack_clf.start_step"] = sizes["indist_attack_clf.max_steps"]
    current = {"batch_size": cfg.schedule.batch_size}
    return {key: value for key, value in sizes.items() if current.get(key) != value}


def _as_overrides(sizes: Dict[str, object]) -> Tuple[str, ...]:
    return tuple(f"{key}={value}" for key, value in sizes.items())


def is_stage1(cfg: TrainConfig) -> bool:
    """Stage 1 trains BatchNorm live (rebm.methods.stages); stage 2 (DAT) does not."""
    return bool(cfg.model.use_batchnorm)


def stage1_for(ckpt_path: Optional[str]) -> Optional[Path]:
    """The stage-1 config whose run writes `ckpt_path` (its run_dir holds it), or None."""
    if not ckpt_path:
        return None
    folder = os.path.normpath(os.path.dirname(ckpt_path))
    for path in sorted(STAGE1_CONFIGS.glob("*.yaml")):
        run_dir = load_config(str(path), []).run.run_dir
        if run_dir and os.path.normpath(run_dir) == folder:
            return path
    return None


def family_of(path: Path, cfg: TrainConfig) -> str:
    """'cifar' or 'imagenet'; a one-line error for a recipe that needs no stand-in data."""
    dataset = cfg.data.indist_dataset
    if dataset in CIFAR:
        return "cifar"
    if dataset == "ImageNet":
        return "imagenet"
    raise ConfigError(f"{path}: data.indist_dataset '{dataset}' needs no stand-in data (the "
                      "quickstart's digits come with scikit-learn: make quickstart runs it)")


def plan_recipe(path: Path) -> Recipe:
    """The stages of the recipe at `path` and their overrides (ConfigError: not a recipe)."""
    if path.resolve().parent.name == "paper":
        raise ConfigError(f"{path} is a paper table, not a training recipe: check its files with "
                          f"python -m rebm.eval.table {path} --checkpoints DIR --check")
    original = load_config(str(path), [])
    family = family_of(path, original)
    stages: List[Stage] = []
    if is_stage1(original):
        config = path
    else:
        config = stage1_for(original.model.ckpt_path) if family == "cifar" else None
    if config is not None:
        cfg = load_config(str(config), [])
        overrides = _as_overrides(size_overrides(cfg, 1, family))
        run_dir = cfg.run.run_dir or f"runs/{config.stem}"
        stages.append(Stage(1, config, run_dir, overrides,
                            load_config(str(config), list(overrides))))
    if not is_stage1(original):
        run_dir = f"runs/{path.stem}"
        overrides = (*_as_overrides(size_overrides(original, 2, family)), f"run_dir={run_dir}")
        stages.append(Stage(2, path, run_dir, overrides, load_config(str(path), list(overrides))))
    return Recipe(path, family, tuple(stages), original)
