"""The AutoAugment CIFAR-10 policy as the original applies it (the default of
`autoaugment_cutout`), on PIL images, with its draws from torch's generator.

Facts (xuwangyin/DAT fb2ffc7, InNOutRobustness/utils/datasets/augmentations/autoaugment.py):
the 25 sub-policies of Cubuk et al. (2019) (lines 72-101); each call picks one uniformly (line
106) and applies its first, then its second operation, each with its own probability (lines
227-230). Magnitude index i in 0..9 selects a value of the ranges of lines 168-183. Where it
differs from torchvision's AutoAugment:
- rotate turns by +m degrees only (counter-clockwise), nearest neighbour, and fills the corners
  with gray 128 whatever the fill (lines 186-188, 203); torchvision turns either way and fills
  with the fill;
- shearX/shearY resample bicubic (lines 191-196); translations are nearest neighbour (197-202);
- solarize inverts pixels at or above thresholds linspace(256, 0, 10) (lines 176, 206), so
  magnitude 0 changes nothing; torchvision's are linspace(255, 0, 10);
- posterize keeps round(linspace(8, 4, 10)) bits (line 175);
- color, contrast, sharpness, brightness enhance by 1 + m or 1 - m (lines 204-212).
The fill of shears and translations is the pipeline's: 0 ("mean0", the DAT CIFAR parameters,
rebm/training/data.py:52-56 with cifar_augmentation.py:22, 58).

Random draws: the original draws from Python's `random` (index, then per operation a uniform and,
for the signed operations it applies, a sign). rebm draws the same quantities from torch's
global CPU generator, all five per image (`draw`), so the per-sample seeding of augmentations.py
fixes them; `apply_subpolicy` then applies a draw deterministically, which is what the test
compares with the original's operations under the same draws.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import numpy as np
import torch
from PIL import Image, ImageEnhance, ImageOps
from torch import Tensor
from torchvision.transforms.v2 import functional as TF

# (probability, operation, magnitude index) twice per sub-policy; the original's lines 73-101
CIFAR10_POLICY: Tuple[Tuple[float, str, int, float, str, int], ...] = (
    (0.1, "invert", 7, 0.2, "contrast", 6),
    (0.7, "rotate", 2, 0.3, "translateX", 9),
    (0.8, "sharpness", 1, 0.9, "sharpness", 3),
    (0.5, "shearY", 8, 0.7, "translateY", 9),
    (0.5, "autocontrast", 8, 0.9, "equalize", 2),
    (0.2, "shearY", 7, 0.3, "posterize", 7),
    (0.4, "color", 3, 0.6, "brightness", 7),
    (0.3, "sharpness", 9, 0.7, "brightness", 9),
    (0.6, "equalize", 5, 0.5, "equalize", 1),
    (0.6, "contrast", 7, 0.6, "sharpness", 5),
    (0.7, "color", 7, 0.5, "translateX", 8),
    (0.3, "equalize", 7, 0.4, "autocontrast", 8),
    (0.4, "translateY", 3, 0.2, "sharpness", 6),
    (0.9, "brightness", 6, 0.2, "color", 8),
    (0.5, "solarize", 2, 0.0, "invert", 3),
    (0.2, "equalize", 0, 0.6, "autocontrast", 0),
    (0.2, "equalize", 8, 0.6, "equalize", 4),
    (0.9, "color", 9, 0.6, "equalize", 6),
    (0.8, "autocontrast", 4, 0.2, "solarize", 8),
    (0.1, "brightness", 3, 0.7, "color", 0),
    (0.4, "solarize", 5, 0.9, "autocontrast", 3),
    (0.9, "translateY", 9, 0.7, "translateY", 9),
    (0.9, "autocontrast", 2, 0.8, "solarize", 3),
    (0.8, "equalize", 8, 0.1, "invert", 3),
    (0.7, "translateY", 9, 0.9, "autocontrast", 1),
)
ROTATE_FILL = (128, 128, 128)  # the original's corners of a rotation, whatever the fill

_ENHANCE = {"color": ImageEnhance.Color, "contrast": ImageEnhance.Contrast,
            "sharpness": ImageEnhance.Sharpness, "brightness": ImageEnhance.Brightness}
_SHEAR_TRANSLATE = ("shearX", "shearY", "translateX", "translateY")
SIGNED = frozenset(_SHEAR_TRANSLATE) | frozenset(_ENHANCE)  # operations that draw a sign


def magnitude(operation: str, index: int):
    """The value of magnitude index 0..9 of `operation` (the original's lines 168-183)."""
    if operation in ("shearX", "shearY"):
        return float(np.linspace(0, 0.3, 10)[index])
    if operation in ("translateX", "translateY"):
        return float(np.linspace(0, 150 / 331, 10)[index])
    if operation == "rotate":
        return float(np.linspace(0, 30, 10)[index])
    if operation in _ENHANCE:
        return float(np.linspace(0.0, 0.9, 10)[index])
    if operation == "posterize":
        return int(np.round(np.linspace(8, 4, 10), 0)[index])
    if operation == "solarize":
        return float(np.linspace(256, 0, 10)[index])
    return 0  # autocontrast, equalize, invert take none


def _affine(image: Image.Image, coefficients, resample, fill) -> Image.Image:
    # PIL maps each output pixel (x, y) to the input (a x + b y + c, d x + e y + f)
    return image.transform(image.size, Image.Transform.AFFINE, coefficients, resample=resample,
                           fillcolor=fill)


def apply_operation(image: Image.Image, operation: str, value, sign: int,
                    fill: Tuple[int, ...]) -> Image.Image:
    """One operation of the policy at magnitude `value`; `sign` (+1/-1) for SIGNED ones."""
    width, height = image.size
    if operation == "shearX":
        return _affine(image, (1, value * sign, 0, 0, 1, 0), Image.Resampling.BICUBIC, fill)
    if operation == "shearY":
        return _affine(image, (1, 0, 0, value * sign, 1, 0), Image.Resampling.BICUBIC, fill)
    if operation == "translateX":
        return _affine(image, (1, 0, value * width * sign, 0, 1, 0), Image.Resampling.NEAREST,
                       fill)
    if operation == "translateY":
        return _affine(image, (1, 0, 0, 0, 1, value * height * sign), Image.Resampling.NEAREST,
                       fill)
    if operation == "rotate":
        return image.rotate(value, resample=Image.Resampling.NEAREST, fillcolor=ROTATE_FILL)
    if operation in _ENHANCE:
        return _ENHANCE[operation](image).enhance(1 + value * sign)
    unsigned: Dict[str, Callable[[], Image.Image]] = {
        "posterize": lambda: ImageOps.posterize(image, value),
        "solarize": lambda: ImageOps.solarize(image, value),
        "autocontrast": lambda: ImageOps.autocontrast(image),
        "equalize": lambda: ImageOps.equalize(image),
        "invert": lambda: ImageOps.invert(image),
    }
    return unsigned[operation]()


@dataclass(frozen=True)
class PolicyDraw:
    """The random choices of one image: the sub-policy, whether each of its two operations
    applies, and their signs (read only by SIGNED operations)."""

    index: int
    applies: Tuple[bool, bool]
    signs: Tuple[int, int]


def draw(policy=CIFAR10_POLICY) -> PolicyDraw:
    """Five draws from torch's global CPU generator, always all five (a fixed count per image)."""
    index = int(torch.randint(len(policy), ()))
    uniform = torch.rand(2).tolist()
    signs = (torch.randint(0, 2, (2,)) * 2 - 1).tolist()
    p1, _, _, p2, _, _ = policy[index]
    return PolicyDraw(index, (uniform[0] < p1, uniform[1] < p2), (signs[0], signs[1]))


def apply_subpolicy(image: Image.Image, choice: PolicyDraw, fill: Tuple[int, ...],
                    policy=CIFAR10_POLICY) -> Image.Image:
    """Sub-policy `choice.index` under `choice`: first operation, then second, as drawn."""
    _, op1, index1, _, op2, index2 = policy[choice.index]
    for applies, operation, index, sign in ((choice.applies[0], op1, index1, choice.signs[0]),
                                            (choice.applies[1], op2, index2, choice.signs[1])):
        if applies:
            image = apply_operation(image, operation, magnitude(operation, index), sign, fill)
    return image


class CIFAR10Policy(torch.nn.Module):
    """The original's CIFAR-10 AutoAugment on a CHW image tensor (uint8, or float in [0, 1],
    which goes through 8 bits as the original's PIL images do); returns the input's dtype."""

    def __init__(self, fill: int = 0):
        super().__init__()
        self.fill = (fill, fill, fill)

    def forward(self, image: Tensor) -> Tensor:
        as_float = image.is_floating_point()
        pixels = TF.to_dtype(image, torch.uint8, scale=True) if as_float else image
        out = TF.pil_to_tensor(apply_subpolicy(TF.to_pil_image(pixels), draw(), self.fill))
        return TF.to_dtype(out, torch.float32, scale=True) if as_float else out

    def extra_repr(self) -> str:
        return f"fill={self.fill}, rotate_fill={ROTATE_FILL}"
