"""The `eval.*` fields of OOD detection against named sets (metric `ood_sets`) and of
counterfactual explanations (metric `counterfactuals`); a base of `EvalConfig`
(rebm/config/evaluation.py), so they sit in the `eval` section. docs/evaluation.md explains them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from rebm.config.errors import ConfigError
from rebm.config.frozen import Frozen

OOD_SCORES = ("msp", "lse")
OOD_SET_NAMES = ("noise", "svhn", "cifar10", "cifar100", "tinyimages", "OpenImageO", "ImageNet",
                 "restricted_imagenet")
COUNTERFACTUAL_PROTOCOLS = ("original", "grid")


@dataclass
class OODCounterfactualFields(Frozen):
    ood_datasets: List[str] = field(default_factory=lambda: ["noise"])  # ood_sets: out-distribution sets: noise, svhn, cifar10, cifar100, tinyimages, OpenImageO, ImageNet, restricted_imagenet (the original's imagenet: ImageNet validation images outside the Restricted-ImageNet classes), or the path of an image folder
    ood_roots: Dict[str, str] = field(default_factory=dict)  # ood_sets: where a named set lives, e.g. {svhn: /data/SVHN}; unset names: data/SVHN, data/CIFAR10, data/CIFAR100, data/tiny_images.bin, data/OpenImage-O-large/val, data/ImageNet (ImageNet and restricted_imagenet)
    ood_num_samples: int = 1024  # ood_sets: images of each set (a fixed subset chosen by rand_seed; noise: the first N of the original's noise); the original's 1024
    ood_image_size: Optional[int] = None  # ood_sets: side the OOD sets are read at (the attack budget follows it); null: 224 for ImageNet (models of 224 and 256 px alike, the original's), data.image_size for every other (32 for CIFAR, the original's) (metric ood reads its out-distribution at the same side)
    ood_score: str = "msp"  # ood_sets: msp (max softmax probability, the original's default) or lse (logsumexp of the logits)
    ood_adversarial: bool = True  # ood_sets: also AUROC / FPR of OOD images moved by L2 PGD to raise the score
    ood_attack_eps: Optional[float] = None  # ood_sets: L2 radius of that attack; null: the original's, 1.0 below 128 px, 3.0 from 128 px
    ood_attack_steps: Optional[int] = None  # ood_sets: its PGD steps; null: 20 below 128 px, 10 from 128 px
    ood_attack_step_size: Optional[float] = None  # ood_sets: its step length; null: 0.1 below 128 px, 1.0 from 128 px
    counterfactual_protocol: str = "original"  # counterfactuals: original (training images, one seeded random target class each, FID per target class) or grid (test images, every other class or counterfactual_num_targets of them)
    counterfactual_num_images: Optional[int] = None  # counterfactuals: images explained, the first N of the split; null: original: the whole training split (the original's 50,000 CIFAR-10 images), grid: 10 test images
    counterfactual_num_targets: Optional[int] = None  # counterfactuals, grid: target classes per image (y+1, y+2, ... mod K); null: every other class
    counterfactual_steps: Optional[int] = None  # counterfactuals: PGD steps toward the target; null: image_log.num_steps
    counterfactual_step_size: Optional[float] = None  # counterfactuals: step length; null: image_log.step_size
    counterfactual_eps: Optional[float] = None  # counterfactuals: radius around the test image; null: image_log.eps
    counterfactual_fid_stats: Optional[str] = None  # counterfactuals: per-class FID statistics, a path with {label} (python -m rebm.eval.counterfactuals CONFIG --class-stats PATH); null: no FID


def validate_ood_counterfactuals(ev, source: str) -> None:
    """Ranges of these fields; raises ConfigError naming the key."""
    if ev.ood_score not in OOD_SCORES:
        raise ConfigError(f"{source}: 'eval.ood_score: {ev.ood_score}' is not valid; use one of "
                          f"{', '.join(OOD_SCORES)}")
    if ev.counterfactual_protocol not in COUNTERFACTUAL_PROTOCOLS:
        raise ConfigError(f"{source}: 'eval.counterfactual_protocol: {ev.counterfactual_protocol}' "
                          f"is not valid; use one of {', '.join(COUNTERFACTUAL_PROTOCOLS)}")
    unknown = [k for k in ev.ood_roots if k not in OOD_SET_NAMES]
    if unknown:
        raise ConfigError(f"{source}: 'eval.ood_roots.{unknown[0]}' is not a named OOD set; "
                          f"use one of {', '.join(OOD_SET_NAMES[1:])}")
    positive = ("ood_num_samples", "ood_image_size", "ood_attack_eps", "ood_attack_steps",
                "ood_attack_step_size", "counterfactual_num_images", "counterfactual_num_targets",
                "counterfactual_steps", "counterfactual_step_size", "counterfactual_eps")
    for key in positive:
        value = getattr(ev, key)
        if value is not None and not value > 0:
            raise ConfigError(f"{source}: 'eval.{key}' must be positive, got {value}")
    stats = ev.counterfactual_fid_stats
    if stats is not None and "{label}" not in stats:
        raise ConfigError(f"{source}: 'eval.counterfactual_fid_stats' must contain {{label}} "
                          f"(one file per class), got '{stats}'")
