"""What both counterfactual protocols share: their settings, the targeted attack that makes a
batch of counterfactuals (8-bit pixels, target confidence, success), the per-class FID against a
class's statistics file, the gather of per-image rows by position and `per_class.json`.

The protocols themselves are rebm.eval.metrics.counterfactuals.grid and rebm.eval.metrics.counterfactuals.original;
the registered metric is rebm.eval.metrics.counterfactuals.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from rebm.attacks.pgd import pgd_attack
from rebm.distributed import Runtime
from rebm.distributed.collectives import all_gather_by_index
from rebm.eval.features.fid import FIDError, frechet_distance, load_reference
from rebm.eval.features.network import FeatureNetwork
from rebm.eval.files import write_text_replacing
from rebm.eval.metric import to_pixels

LOGGER = logging.getLogger("rebm")
# 8-bit counterfactuals as the original wrote them: torchvision's save_image rounds
# (eval_utils.py's generate_counterfactuals, vutils.save_image)
COUNTERFACTUAL_PIXELS = "round"


@dataclass(frozen=True)
class CounterfactualSettings:
    """What the counterfactuals compute (the `eval.counterfactual_*` fields; the defaults are
    the config's where it has one)."""

    protocol: str = "original"
    # images explained, the first N of the split; None: original: every training image,
    # grid: GRID_NUM_IMAGES test images (rebm.eval.metrics.counterfactuals.grid)
    num_images: Optional[int] = None
    num_targets: Optional[int] = None  # grid: None: every other class
    steps: int = 20
    step_size: float = 0.1
    eps: float = math.inf
    norm: str = "L2"
    fid_stats: Optional[str] = None  # per-class reference statistics, a path with {label}
    image_log: Any = None  # the ImageLogConfig whose feature network computes that FID


def stats_classes(template: Optional[str], num_classes: int) -> List[int]:
    """The classes whose statistics file `template.format(label=c)` exists."""
    if not template:
        return []
    return [c for c in range(num_classes) if os.path.isfile(template.format(label=c))]


def attack_toward(model: nn.Module, x: Tensor, targets: Tensor,
                  settings: CounterfactualSettings) -> Tuple[Tensor, Tensor, Tensor]:
    """Counterfactuals of the images `x` toward the classes `targets` (one each) by targeted
    PGD ascent on the target logit: (uint8 pixels as save_image writes them, float64
    confidence in the target, float64 success 0/1)."""
    adv = pgd_attack(model, x, steps=settings.steps, step_size=settings.step_size,
                     eps=settings.eps, norm=settings.norm, objective="logit", y=targets)
    with torch.no_grad():
        logits = model(adv).double()
        confidence = logits.softmax(dim=1).gather(1, targets[:, None])[:, 0]
        success = (logits.argmax(dim=1) == targets).double()
    return to_pixels(adv, COUNTERFACTUAL_PIXELS), confidence, success


def class_fid(c: int, mu: np.ndarray, sigma: np.ndarray, template: str,
              network: FeatureNetwork) -> Optional[float]:
    """FID of (mu, sigma) against class c's statistics file (made by `network`); None (a
    warning) without one."""
    try:
        reference = load_reference(template.format(label=c), network, dims=mu.shape[0],
                                   key="eval.counterfactual_fid_stats")
        return frechet_distance(mu, sigma, *reference)
    except (FIDError, ValueError) as err:
        LOGGER.warning("counterfactual FID of class %d skipped: %s", c, err)
        return None


def gather_parts_all_ranks(runtime: Runtime, parts: List[Tuple[Tensor, Tensor]], n: int,
                           shape: tuple) -> Tensor:
    """Every rank's (positions, rows) parts, rows put at their positions of [0, n), on every
    rank (cpu). `shape`: (dtype, *row shape), for a rank without parts."""
    empty = torch.zeros((0, *shape[1:]), dtype=shape[0], device=runtime.device)
    positions = torch.cat([p for p, _ in parts] or [empty.new_zeros(0, dtype=torch.int64)])
    rows = torch.cat([r for _, r in parts] or [empty])
    return all_gather_by_index(runtime, rows, positions, n).cpu()


def write_per_class(folder: str, per_class: Dict[str, Dict[int, Any]]) -> None:
    """`<folder>/per_class.json`: {result: {class: value}}."""
    text = json.dumps({k: {str(c): v for c, v in d.items()} for k, d in per_class.items()},
                      indent=2)
    write_text_replacing(os.path.join(folder, "per_class.json"), text)
