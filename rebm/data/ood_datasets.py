"""Out-of-distribution evaluation sets: named image sets (and image folders) that OOD detection
scores against the in-distribution test set (rebm/eval/metrics/ood_sets.py, docs/evaluation.md).

A set is named by `spec`: one of `OOD_SET_NAMES`, read from its root (`roots[name]`, default
`DEFAULT_ROOTS`), or the path of an image folder. Every set is brought to the evaluation size
the way the original OOD evaluation did (no augmentation: 32 px sets resized bilinearly, as
PIL does, full-size files through the fixed `none` resize, PIL bicubic to S x S) and evaluated
on a fixed subset of `num_samples` images: positions 0 .. n-1 of a keyed permutation of the
set (seed `rand_seed`), the same images on any number of processes. (The original's subset, the
first 1024 of a shuffled loader after torch.manual_seed(rand_seed), also depends on the random
draws of building its model, so it cannot be reproduced image for image.) `noise` is the
original's noise itself: its first n images, in order.

Splits follow the original: SVHN, CIFAR-10 and CIFAR-100 their training split, ImageNet its
validation split, `restricted_imagenet` the validation images outside the Restricted-ImageNet
classes (the original's `imagenet` set), OpenImage-O the folder given (by default its `val`
part).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor
from torchvision import datasets as tv_datasets
from torchvision.transforms.v2 import functional as TF

from rebm.config import DataConfig
from rebm.config.evaluation_ood import OOD_SET_NAMES
from rebm.data.augmentations import Transform, build_augmentation
from rebm.data.files import load_cifar, load_unlabelled_folder
from rebm.data.imagenet import load_imagenet, load_openimage_o
from rebm.data.indexing import KeyedPermutation
from rebm.data.pipeline import indist_source
from rebm.data.sources import (
    DataError,
    ImageSource,
    TensorSource,
    TinyImagesSource,
    log_replaced_once,
    one_line,
)

LOGGER = logging.getLogger(__name__)

DEFAULT_ROOTS = {
    "svhn": "data/SVHN",
    "cifar10": "data/CIFAR10",
    "cifar100": "data/CIFAR100",
    "tinyimages": "data/tiny_images.bin",
    "OpenImageO": "data/OpenImage-O-large/val",
    "ImageNet": "data/ImageNet",
    "restricted_imagenet": "data/ImageNet",  # the original's path="./data/ImageNet"
}
# The Restricted-ImageNet classes as inclusive ranges of ImageNet class indices (torchvision's
# numbering, sorted wnids): RESTRICTED_IMAGNET_RANGES of the original's
# InNOutRobustness/utils/datasets/imagenet_subsets.py (lines 94-96, taken from MadryLab's
# robustness/tools/constants.py): dog, cat, frog, turtle, bird, monkey, fish, crab, insect.
# Its RestrictedImageNetOD keeps the images of every other class (797 of 1000).
RESTRICTED_IMAGENET_RANGES = ((151, 268), (281, 285), (30, 32), (33, 37), (80, 100),
                              (365, 382), (389, 397), (118, 121), (300, 319))
# The original's noise set: InNOutRobustness/utils/datasets/noise_datasets.py seeds numpy with
# 123, draws np.random.rand(length, 3, S, S) as float32, and each image goes through
# ToPILImage (float -> uint8 by truncation of 255 x) and ToTensor.
ORIGINAL_NOISE_SEED = 123
SUBSET_EPOCH = 1  # the keyed permutation's epoch slot for OOD subsets (0 is training's first)
_warned_unchecked: set = set()


class _UncheckedSVHN(tv_datasets.SVHN):
    """torchvision's SVHN loader with the md5 check reduced to an existence check: for files
    that exist but are not the official release (a re-packed or test copy). The .mat file is
    still read by torchvision's own code (scipy.io.loadmat, which runs no code)."""

    split_list = {k: [url, name, None] for k, (url, name, _md5) in
                  tv_datasets.SVHN.split_list.items()}


def load_svhn(root: str, split: str, size: int) -> ImageSource:
    """SVHN `split` (train, test, extra) from `<root>/<split>_32x32.mat` through torchvision."""
    path = os.path.join(root, f"{split}_32x32.mat")
    if not os.path.isfile(path):
        raise DataError(f"SVHN file {path} does not exist; download {split}_32x32.mat from "
                        "http://ufldl.stanford.edu/housenumbers/ into that folder")
    try:
        try:
            ds = tv_datasets.SVHN(root, split=split, download=False)
        except RuntimeError:  # md5 mismatch: not the official file
            if path not in _warned_unchecked:
                _warned_unchecked.add(path)
                LOGGER.warning("%s differs from the official SVHN release (md5); loading it "
                               "anyway", path)
            ds = _UncheckedSVHN(root, split=split, download=False)
    except Exception as err:  # not a .mat, no X/y, wrong shapes
        raise DataError(f"{path}: cannot read SVHN ({one_line(err)}); re-download "
                        f"{split}_32x32.mat") from None
    images = torch.from_numpy(np.ascontiguousarray(ds.data))
    if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
        raise DataError(f"{path}: X is not uint8 32x32x3xN images; re-download "
                        f"{split}_32x32.mat")
    source = TensorSource(images, torch.as_tensor(ds.labels, dtype=torch.int64),
                          f"SVHN {split}")
    return _resized(source, size)


class ResizedSource(ImageSource):
    """A set of small images (32 px SVHN, CIFAR) read at another side: each batch resized on
    access by PIL's bilinear Resize, image by image, the original's operation
    (InNOutRobustness/utils/datasets/augmentations/cifar_augmentation.py:100,
    svhn_augmentation.py:55), on every CPU. torchvision's antialiased uint8 resize gives PIL's
    bytes only through its AVX2 kernel; elsewhere (Arm, x86 without AVX2) 13 % of the bytes of
    a noise image differ by 1. Per batch, not the whole set at once: CIFAR-100 at 224 px would
    hold 7.5 GB per process."""

    def __init__(self, source: TensorSource, size: int):
        self.source, self.size, self.name = source, size, source.name

    def __len__(self) -> int:
        return len(self.source)

    def images(self, indices: np.ndarray) -> Tensor:
        from PIL import Image

        side = (self.size, self.size)
        return torch.stack([TF.pil_to_tensor(TF.to_pil_image(image).resize(side, Image.BILINEAR))
                            for image in self.source.images(indices)])

    def labels(self, indices: np.ndarray) -> Tensor:
        return self.source.labels(indices)


def _resized(source: TensorSource, size: int) -> ImageSource:
    return source if source.data.shape[-1] == size else ResizedSource(source, size)


@dataclass
class FixedImageSet:
    """A fixed list of images of a source (an OOD subset, a test set), read by position
    0 .. n-1 without randomness; picklable, so loader workers can read it."""

    name: str
    source: ImageSource
    transform: Optional[Transform]
    indices: np.ndarray  # dataset index of each position
    size: int  # side of the images read

    def labels(self, positions: np.ndarray) -> Tensor:
        return self.source.labels(self.indices[np.asarray(positions, dtype=np.int64)])

    def __len__(self) -> int:
        return len(self.indices)

    def images(self, positions: np.ndarray) -> Tensor:
        """Float [0, 1] images (k, 3, S, S) of the given positions."""
        batch = self.source.read(self.indices[np.asarray(positions, dtype=np.int64)],
                                 self.transform, None)
        log_replaced_once(batch.replaced, f" ({self.name})")
        return batch.images


def restricted_imagenet_outside(root: str, size: int) -> Tuple[ImageSource, np.ndarray]:
    """(ImageNet's validation split, the indices of its images outside the Restricted-ImageNet
    classes): the original's RestrictedImageNetOD(path, split='val')."""
    source = load_imagenet(root, "test", size, 1000)
    labels = source.labels(np.arange(len(source))).numpy()
    inside = np.zeros(len(labels), dtype=bool)
    for first, last in RESTRICTED_IMAGENET_RANGES:
        inside |= (labels >= first) & (labels <= last)
    return source, np.flatnonzero(~inside)


def original_noise(length: int, size: int) -> TensorSource:
    """The first `length` images of the original's uniform noise at `size` px, bit for bit
    (ORIGINAL_NOISE_SEED): numpy's stream is drawn image by image, which is the same stream as
    the original's single draw."""
    rng = np.random.RandomState(ORIGINAL_NOISE_SEED)
    images = torch.empty((length, 3, size, size), dtype=torch.uint8)
    for i in range(length):
        uniform = rng.random_sample((3, size, size)).astype(np.float32)
        images[i] = torch.from_numpy((uniform * np.float32(255)).astype(np.uint8))
    return TensorSource(images, None, "uniform noise")


def _named_source(name: str, root: str, size: int, num_samples: int
                  ) -> Tuple[ImageSource, Optional[np.ndarray]]:
    """(source, the indices a subset is drawn from, None: all of them)."""
    if name == "noise":
        return original_noise(num_samples, size), None
    if name == "svhn":
        return load_svhn(root, "train", size), None
    if name in ("cifar10", "cifar100"):
        return _resized(load_cifar(root, 10 if name == "cifar10" else 100, True, False),
                        size), None
    if name == "tinyimages":
        path = os.path.join(root, "tiny_images.bin") if os.path.isdir(root) else root
        return TinyImagesSource(path, size), None
    if name == "OpenImageO":
        return load_openimage_o(root, size, None), None
    if name == "restricted_imagenet":
        return restricted_imagenet_outside(root, size)
    return load_imagenet(root, "test", size, 1000), None  # ImageNet: the validation split


def ood_set_name(spec: str) -> str:
    """The name a set is reported under: its name, or an image folder's base name."""
    return spec if spec in OOD_SET_NAMES else os.path.basename(os.path.normpath(spec))


def load_ood_set(spec: str, size: int, seed: int, num_samples: int,
                 roots: Optional[Mapping[str, str]] = None) -> FixedImageSet:
    """The OOD set named by `spec` (a name of OOD_SET_NAMES or an image folder) at `size` px:
    the first `num_samples` images of its keyed permutation (noise: its first images).
    DataError (one line naming the set, the path and the config key) when it cannot be read."""
    roots = {**DEFAULT_ROOTS, **(roots or {})}
    name = ood_set_name(spec)
    if spec in OOD_SET_NAMES:
        root = roots.get(spec, "")
    elif os.sep in spec or os.path.isdir(spec):
        root = spec
    else:
        raise DataError(f"unknown OOD set '{spec}' in eval.ood_datasets; use one of "
                        f"{', '.join(OOD_SET_NAMES)} or the path of an image folder")
    try:
        if spec in OOD_SET_NAMES:
            source, eligible = _named_source(name, root, size, num_samples)
        else:
            source, eligible = load_unlabelled_folder(root, size), None
    except DataError as err:
        key = f"eval.ood_roots.{name}" if spec in OOD_SET_NAMES else "eval.ood_datasets"
        raise DataError(f"OOD set '{name}' ({key}): {err}") from None
    if eligible is None:
        eligible = np.arange(len(source), dtype=np.int64)
    n = min(num_samples, len(eligible))
    if spec == "noise":  # the original's noise images, in order
        indices = eligible[:n]
    else:
        indices = eligible[KeyedPermutation(len(eligible), seed, "eval", SUBSET_EPOCH)(
            np.arange(n))]
    transform = None if source.is_procedural else build_augmentation(
        "none", size, source.full_images)
    return FixedImageSet(name, source, transform, indices, size)


def indist_test_set(data: DataConfig, indices: Optional[Sequence[int]] = None) -> FixedImageSet:
    """The in-distribution test split at data.image_size with the evaluation transform (as
    `build_eval_data`): the images of `indices` (dataset indices, in that order), or all."""
    source = indist_source(data, "test")
    transform = build_augmentation("test", data.image_size, source.full_images)
    chosen = np.arange(len(source)) if indices is None else np.asarray(indices, dtype=np.int64)
    return FixedImageSet(source.name, source, transform, chosen, data.image_size)
