"""Training augmentations by name (torchvision.transforms.v2), applied per sample with a seed.

Names (config keys `augm_type_generation`, `augm_type_classification`):
- `original`: RandomCrop(image_size, padding image_size // 8 — 4 px at 32 — zero fill) +
  horizontal flip;
- `autoaugment_cutout`: crop + flip + AutoAugment (CIFAR-10 policy, black fill) + Cutout of
  image_size // 2 px (16 at 32) with black fill ("mean0": every fill colour is 0);
- `none` / `test`: nothing.

Transforms take one CHW image tensor (uint8, or float in [0, 1]) and return the same dtype; the
batch is converted to float [0, 1] once after stacking.

Reproducibility: v2 RandomCrop/RandomHorizontalFlip/AutoAugment and `Cutout` below draw only from
torch's global CPU generator (torch.rand / torch.randint), so seeding that generator with a
per-sample seed right before the transform fixes the sample's augmentation, whatever the world
size, worker count or resume point. `augment_batch` does this inside `torch.random.fork_rng`
so the caller's RNG state is left untouched.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor
from torchvision.transforms import v2

AUGMENTATION_NAMES = ("original", "autoaugment_cutout", "none", "test")

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


def _crop_flip(image_size: int) -> list:
    padding = max(1, image_size // 8)  # 4 px at 32 px, scaled for other sizes
    return [
        v2.RandomCrop(image_size, padding=padding, fill=0, padding_mode="constant"),
        v2.RandomHorizontalFlip(),
    ]


def build_augmentation(name: str, image_size: int) -> Optional[Transform]:
    """The per-sample transform of an augmentation name; None means identity (no randomness)."""
    if name in ("none", "test"):
        return None
    if name == "original":
        return v2.Compose(_crop_flip(image_size))
    if name == "autoaugment_cutout":
        return v2.Compose(
            _crop_flip(image_size)
            + [
                v2.AutoAugment(v2.AutoAugmentPolicy.CIFAR10, fill=0),
                Cutout(max(1, image_size // 2)),
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
