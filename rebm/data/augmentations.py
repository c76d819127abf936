"""Training augmentations by name (torchvision.transforms.v2), applied per sample with a seed.

Names (config keys `augm_type_generation`, `augm_type_classification`, `openimages_augm`):
- `original`: RandomCrop(image_size, padding image_size // 8 — 4 px at 32 — zero fill) +
  horizontal flip;
- `autoaugment_cutout`: crop + flip + the original's AutoAugment CIFAR-10 policy
  (autoaugment.py: black fill of shears and translations, gray 128 corners of rotations) +
  Cutout of `data.cutout_size` px, unset image_size // 2 (16 at 32), with black fill ("mean0":
  the crop, policy and Cutout fills are 0, as the original's cifar_augmentation.py:54-60,
  102-106 with the DAT mean (0, 0, 0));
- `none` / `test`: nothing (on full-resolution images, ImageNet and OpenImage-O: the fixed
  resizes below);
- the ImageNet names, which take an image of any size to image_size S (the original DAT
  ImageNet transforms; S = 224 or 256):
  `madry` RandomResizedCrop(S) + flip + ColorJitter(0.1, 0.1, 0.1) + PCA lighting (std 0.05,
  not clamped: the only name whose values may leave [0, 1], by the lighting shift);
  `default` and `generation_od` RandomResizedCrop(S) + flip;
  `generation_od_randomcrop` RandomResizedCrop(S) + RandomCrop(S, padding 4S/32) + flip;
  `generation_id` Resize(S) + CenterCrop(S) + flip;
  `generation_id_randomcrop` Resize(floor(S / 0.875)) + CenterCrop(S) + RandomCrop(S, padding 4S/32)
  + flip; on full-resolution images `test` is Resize(floor(S / 0.875), bicubic) + CenterCrop(S) and
  `none` is Resize((S, S), bicubic).

Transforms take one CHW image tensor (uint8, or float in [0, 1]) and return the same dtype
(`madry` returns float); the batch is converted to float once after stacking.

Reproducibility: the v2 transforms used here (crops, flips, ColorJitter), the AutoAugment policy
(autoaugment.py) and `Cutout` and `Lighting` below draw only from torch's global CPU generator
(torch.rand / torch.randint / normal_), so seeding that generator with a per-sample seed right
before the transform fixes the sample's augmentation, whatever the world
size, worker count or resume point. `augment_batch` does this inside `torch.random.fork_rng`
so the caller's RNG state is left untouched.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor
from torchvision.transforms import v2

from rebm.data.autoaugment import CIFAR10Policy

IMAGENET_AUGMENTATIONS = ("madry", "default", "generation_id", "generation_id_randomcrop",
                          "generation_od", "generation_od_randomcrop")
AUGMENTATION_NAMES = ("original", "autoaugment_cutout", "none", "test") + IMAGENET_AUGMENTATIONS

# PCA lighting noise of AlexNet, with the ImageNet RGB eigenvalues / eigenvectors (columns)
IMAGENET_EIGVAL = (0.2175, 0.0188, 0.0045)
IMAGENET_EIGVEC = ((-0.5675, 0.7192, 0.4009),
                   (-0.5808, -0.0045, -0.8140),
                   (-0.5836, -0.6948, 0.4203))

Transform = Callable[[Tensor], Tensor]


class Cutout(torch.nn.Module):
    """Zero a `size` x `size` square whose centre is uniform over the image (the square may be
    clipped at the border), as in DeVries & Taylor (2017). Fill 0 = black ("mean0")."""

    def __init__(self, size: int, fill: float = 0.0):
        super().__init__()
        self.size = size
        self.fill = fill

    def forward(self, image: Tensor) -> Tensor:
        height, width = image.shape[-2:]
        cy = int(torch.randint(0, height, ()))
        cx = int(torch.randint(0, width, ()))
        y0, y1 = max(0, cy - self.size // 2), min(height, cy + self.size - self.size // 2)
        x0, x1 = max(0, cx - self.size // 2), min(width, cx + self.size - self.size // 2)
        out = image.clone()
        out[..., y0:y1, x0:x1] = self.fill
        return out

    def extra_repr(self) -> str:
        return f"size={self.size}, fill={self.fill}"


class Lighting(torch.nn.Module):
    """AlexNet-style PCA lighting: add sum_j eigvec[:, j] * alpha_j * eigval_j, alpha ~ N(0, std)
    per image, to every pixel of a float [0, 1] image, in the original's arithmetic (its
    imagenet_augmentation.py:34-40: one normal_(0, std) draw of 3, the products in that order,
    summed over j). Not clamped, as the original's: a pixel near 0 or 1 may leave [0, 1] by the
    shift (|shift| < 0.02 in practice); the attacks' projection clamps what they move."""

    def __init__(self, std: float):
        super().__init__()
        self.std = std
        self.register_buffer("eigval", torch.tensor(IMAGENET_EIGVAL), persistent=False)
        self.register_buffer("eigvec", torch.tensor(IMAGENET_EIGVEC), persistent=False)

    def forward(self, image: Tensor) -> Tensor:
        alpha = torch.empty(3).normal_(0.0, self.std)
        shift = (self.eigvec * alpha.view(1, 3) * self.eigval.view(1, 3)).sum(dim=1)
        return image + shift.view(3, 1, 1)


class FullImageTransform(v2.Compose):
    """A transform that takes a decoded image of any size to image_size x image_size (the
    ImageNet names); full-resolution sources apply it to the decoded file directly. It accepts a
    PIL image (the geometric steps then run in PIL, several times faster than antialiased
    resizes of uint8 tensors, and pixel-identical to the original's PIL pipeline) or a CHW
    tensor, and returns a tensor."""


def imagenet_augmentation(name: str, size: int) -> FullImageTransform:
    """The ImageNet transforms of the module docstring, on PIL images or uint8 CHW tensors of
    any size."""
    bicubic = v2.InterpolationMode.BICUBIC
    # floor(S / 0.875) in integers (crop_pct 0.875, as the original's evaluate_imagenet_robustbench.py):
    # 256 at 224 px, 292 at 256 px
    resized = size * 8 // 7
    padding = int(4 * size / 32)
    flip = v2.RandomHorizontalFlip()
    steps = {
        "none": [v2.Resize((size, size), interpolation=bicubic, antialias=True)],
        "test": [v2.Resize(resized, interpolation=bicubic, antialias=True), v2.CenterCrop(size)],
        "generation_id": [v2.Resize(size, antialias=True), v2.CenterCrop(size), flip],
        "generation_id_randomcrop": [v2.Resize(resized, antialias=True), v2.CenterCrop(size),
                                     v2.RandomCrop(size, padding=padding), flip],
        "default": [v2.RandomResizedCrop(size, antialias=True), flip],
        "generation_od": [v2.RandomResizedCrop(size, antialias=True), flip],
        "generation_od_randomcrop": [v2.RandomResizedCrop(size, antialias=True),
                                     v2.RandomCrop(size, padding=padding), flip],
        "madry": [v2.RandomResizedCrop(size, antialias=True), flip,
                  v2.ColorJitter(brightness=0.1, contrast=0.1, saturation=0.1)],
    }
    # PILToTensor leaves tensors alone, so the same transform takes both inputs
    tail = [v2.ToDtype(torch.float32, scale=True), Lighting(0.05)] if name == "madry" else []
    return FullImageTransform(steps[name] + [v2.PILToTensor()] + tail)


class CenterSquare(torch.nn.Module):
    """The largest centred square of an image (PIL or CHW tensor): CenterCrop(min side)."""

    def forward(self, image):
        return v2.functional.center_crop(image, min(v2.functional.get_size(image)))


def center_square_resize(size: int) -> FullImageTransform:
    """CenterCrop(min side) + bilinear Resize((size, size)), PIL or uint8 CHW tensor in, uint8
    tensor out: how the original's vendored pytorch-fid/src/pytorch_fid/fid_score2.py:146-153
    reads images for 256 px FID statistics (rebm.eval.fid_stats --recipe fid_score2)."""
    return FullImageTransform([CenterSquare(), v2.Resize((size, size), antialias=True),
                               v2.PILToTensor()])


def _crop_flip(image_size: int) -> list:
    padding = max(1, image_size // 8)  # 4 px at 32 px, scaled for other sizes
    return [
        v2.RandomCrop(image_size, padding=padding, fill=0, padding_mode="constant"),
        v2.RandomHorizontalFlip(),
    ]


def build_augmentation(name: str, image_size: int, full_images: bool = False,
                       cutout_size: Optional[int] = None) -> Optional[Transform]:
    """The per-sample transform of an augmentation name; None means identity (no randomness).
    `full_images`: the source yields decoded files of any size (ImageNet, OpenImage-O), so
    `none` and `test` are the fixed resizes to image_size instead of the identity.
    `cutout_size`: autoaugment_cutout's Cutout side (data.cutout_size; None: image_size // 2)."""
    if name in IMAGENET_AUGMENTATIONS or (full_images and name in ("none", "test")):
        return imagenet_augmentation(name, image_size)
    if name in ("none", "test"):
        return None
    if name == "original":
        return v2.Compose(_crop_flip(image_size))
    if name == "autoaugment_cutout":
        return v2.Compose(
            _crop_flip(image_size)
            + [
                CIFAR10Policy(fill=0),
                Cutout(cutout_size or max(1, image_size // 2)),
            ]
        )
    raise ValueError(
        f"unknown augmentation '{name}'; use one of {', '.join(AUGMENTATION_NAMES)}"
    )


def to_float01(images: Tensor) -> Tensor:
    """uint8 [0, 255] or float [0, 1] images -> float32 [0, 1]."""
    if images.dtype == torch.uint8:
        return images.float().div_(255.0)
    return images.float()


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run torch ops on one intra-op thread, then restore the setting. Per-image ops on 32x32
    images are far too small to split over threads: the hand-offs only cost (autoaugment_cutout
    ran 18x slower with 2 threads than with 1 on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def augment_batch(
    images: Tensor, transform: Optional[Transform], seeds: Optional[Sequence[int]]
) -> Tensor:
    """Apply `transform` to each image of an (N, C, H, W) batch -> float32 [0, 1].

    With `seeds`, image i is transformed right after seeding torch's global CPU generator with
    seeds[i] (inside fork_rng, so the caller's RNG is restored). Without seeds the ambient RNG is
    used (plain DataLoader semantics). Only the CPU default generator is seeded: seeding CUDA from
    a data path would disturb the training process's GPU RNG.
    """
    if transform is None:
        return to_float01(images)
    with single_threaded():
        if seeds is None:
            return to_float01(torch.stack([transform(img) for img in images]))
        out = []
        with torch.random.fork_rng(devices=[]):
            for img, seed in zip(images, seeds, strict=True):
                torch.default_generator.manual_seed(int(seed))
                out.append(transform(img))
        return to_float01(torch.stack(out))
