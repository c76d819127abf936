"""Image sources (the storage kinds: in-memory tensors, image files, 80M TinyImages, procedural
noise) and the one error type for bad data (`DataError`, a one-line message that names the path
and the fix). The datasets built on them (CIFAR, digits, folders, tensor files) are in files.py.

A *source* is indexable storage that returns a batch of images for an array of indices:
`source.images(idx) -> (k, 3, S, S)` uint8 (or float in [0, 1]) at the configured image size, and
`source.labels(idx) -> (k,)` int64 (-1 where there are no classes). Samplers and augmentation
live elsewhere (indexing.py, augmentations.py); `ImageDataset` adapts a source to a torch
`Dataset` of (float image, label) for evaluation and stage-1 code.

Small sets (CIFAR: 50k x 3 x 32 x 32 uint8 = 150 MB) are decoded once into one tensor in memory;
TinyImages stays on disk (memory-mapped); image folders are decoded per access.
"""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass
from typing import Optional, Sequence, Set, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.transforms.v2 import functional as TF

from rebm.data.augmentations import Transform, augment_batch
from rebm.data.indexing import sample_keys
from rebm.errors import UserError

LOGGER = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
TINY_RECORD_BYTES = 32 * 32 * 3
DEFAULT_NOISE_LENGTH = 50_000


class DataError(UserError, ValueError):
    """A data problem the user can fix; the message is one line naming the path and the fix."""


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


@dataclass
class SourceBatch:
    """What a source gives for a batch of indices: float32 [0, 1] images at image_size, their
    labels, and the files that could not be decoded and were replaced (see imagenet.py)."""

    images: Tensor
    labels: Tensor
    replaced: Tuple[str, ...] = ()


_LOGGED_BAD_FILES: Set[str] = set()  # per process: each unreadable file is logged once


def log_replaced_once(paths: Sequence[str], where: str = "") -> None:
    """Log every file of `paths` not logged by this process before (one warning line each)."""
    for path in paths:
        if path not in _LOGGED_BAD_FILES:
            _LOGGED_BAD_FILES.add(path)
            LOGGER.warning("unreadable image %s replaced by the next readable one%s", path, where)


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------
class ImageSource:
    """Indexable image storage (see the module docstring)."""

    name = "images"
    full_images = False  # True: files decoded at full resolution (augmentations resize them)

    def __len__(self) -> int:
        raise NotImplementedError

    def images(self, indices: np.ndarray) -> Tensor:
        raise NotImplementedError

    def labels(self, indices: np.ndarray) -> Tensor:
        return torch.full((len(indices),), -1, dtype=torch.int64)

    @property
    def is_procedural(self) -> bool:
        """True for generated noise (no augmentation is applied to it)."""
        return False

    def read(self, indices: np.ndarray, transform: Optional[Transform],
             seeds: Optional[Sequence[int]]) -> SourceBatch:
        """Images of `indices` through `transform` (image i seeded by seeds[i]), as float [0, 1],
        with their labels."""
        images = augment_batch(self.images(indices), transform, seeds)
        return SourceBatch(images, self.labels(indices))


class TensorSource(ImageSource):
    """Images held in memory as one (N, 3, S, S) tensor (uint8 or float [0, 1])."""

    def __init__(self, images: Tensor, labels: Optional[Tensor], name: str):
        self.data = images
        self.targets = labels
        self.name = name

    def __len__(self) -> int:
        return self.data.shape[0]

    def images(self, indices: np.ndarray) -> Tensor:
        return self.data[torch.as_tensor(np.asarray(indices, dtype=np.int64))]

    def labels(self, indices: np.ndarray) -> Tensor:
        if self.targets is None:
            return super().labels(indices)
        return self.targets[torch.as_tensor(np.asarray(indices, dtype=np.int64))]


class ImageFileSource(ImageSource):
    """Image files decoded on access, resized (shorter side) and centre-cropped to `size`."""

    def __init__(self, files: Sequence[str], labels: Optional[Sequence[int]], size: int,
                 name: str):
        self.files = list(files)
        self.targets = None if labels is None else torch.as_tensor(labels, dtype=torch.int64)
        self.size = size
        self.name = name

    def __len__(self) -> int:
        return len(self.files)

    def _decode(self, path: str) -> Tensor:
        from PIL import Image

        try:
            with Image.open(path) as img:
                image = TF.pil_to_tensor(img.convert("RGB"))
        except OSError as err:
            raise DataError(f"{path}: cannot decode image ({one_line(err)})") from None
        image = TF.resize(image, [self.size], antialias=True)
        return TF.center_crop(image, [self.size, self.size])

    def images(self, indices: np.ndarray) -> Tensor:
        return torch.stack([self._decode(self.files[int(i)]) for i in indices])

    def labels(self, indices: np.ndarray) -> Tensor:
        if self.targets is None:
            return super().labels(indices)
        return self.targets[torch.as_tensor(np.asarray(indices, dtype=np.int64))]


class TinyImagesSource(ImageSource):
    """80M TinyImages `tiny_images.bin`: 3072-byte uint8 records, memory-mapped (never read whole;
    only the records of a batch are touched).

    Record layout (as in the original 80M TinyImages loaders,
    `np.frombuffer(record).reshape(32, 32, 3, order="F")`): channel-major, and inside a channel
    column-major — byte c*1024 + x*32 + y holds pixel (row y, column x) of channel c. So
    `record.reshape(3, 32, 32)` is (C, W, H) and one transpose gives CHW.

    Optional exclusion (records that overlap CIFAR, the original's lists by default, read and
    checked by rebm/data/sets/tinyimages.py): a sorted array `excluded` of record numbers;
    virtual index v maps to record v + #{k : excluded[k] - k <= v} (binary search), so
    nothing proportional to the 80M records is ever materialised.
    """

    name = "tinyimages"

    def __init__(self, path: str, size: int, excluded: Optional[np.ndarray] = None):
        self.path = path
        self.size = size
        self.num_records = tinyimages_record_count(path)
        excluded = np.zeros(0, np.int64) if excluded is None else excluded
        self.num_excluded = len(excluded)
        # kept records before each excluded one; searchsorted on it maps virtual -> record
        self._kept_before = excluded - np.arange(len(excluded), dtype=np.int64)
        self._records: Optional[np.ndarray] = None  # memory map, opened lazily per process

    def __len__(self) -> int:
        return self.num_records - self.num_excluded

    def __getstate__(self) -> dict:  # never pickle the mapping (spawned workers reopen it)
        state = self.__dict__.copy()
        state["_records"] = None
        return state

    def _open(self) -> np.ndarray:
        """(num_records, 3072) uint8 view of the file through a read-only memory map.

        mmap + MADV_RANDOM rather than np.memmap: reads are single random records, and the
        default read-around fetches ~128 KiB per page fault (measured: 0.5 s vs 3 ms for the
        first batch of 128 records on an 80M-record file)."""
        with open(self.path, "rb") as f:
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if hasattr(mmap, "MADV_RANDOM"):
            mapping.madvise(mmap.MADV_RANDOM)
        # the array keeps the mapping alive; nothing is read until records are indexed
        return np.frombuffer(mapping, dtype=np.uint8).reshape(self.num_records, TINY_RECORD_BYTES)

    def record_numbers(self, indices: np.ndarray) -> np.ndarray:
        v = np.asarray(indices, dtype=np.int64)
        return v + np.searchsorted(self._kept_before, v, side="right")

    def images(self, indices: np.ndarray) -> Tensor:
        if self._records is None:
            self._records = self._open()
        records = self._records[self.record_numbers(indices)]  # fancy index = a copy of k records
        chw = records.reshape(-1, 3, 32, 32).transpose(0, 1, 3, 2)
        images = torch.from_numpy(np.ascontiguousarray(chw))
        if self.size != 32:
            images = TF.resize(images, [self.size, self.size], antialias=True)
        return images


class NoiseSource(ImageSource):
    """Procedural out-distribution: image i is uniform [0, 1] noise drawn from (seed, i) — at
    `low_res` x `low_res` then bilinearly upsampled for low-frequency noise. `length` is virtual."""

    def __init__(self, length: int, size: int, seed: int, low_res: Optional[int] = None):
        self.length = length
        self.size = size
        self.seed = seed
        self.low_res = low_res
        self.name = "lowfreq-noise" if low_res else "uniform-noise"

    def __len__(self) -> int:
        return self.length

    @property
    def is_procedural(self) -> bool:
        return True

    def images(self, indices: np.ndarray) -> Tensor:
        res = self.low_res or self.size
        keys = sample_keys(self.seed, "noise", 0, indices)
        gen = torch.Generator()
        noise = []
        for key in keys:
            gen.manual_seed(int(key))
            noise.append(torch.rand(3, res, res, generator=gen))
        batch = torch.stack(noise) if noise else torch.zeros(0, 3, res, res)
        if res != self.size:
            batch = F.interpolate(batch, size=(self.size, self.size), mode="bilinear",
                                  align_corners=False)
        return batch


class ImageDataset(torch.utils.data.Dataset):
    """(float [0, 1] CHW image, int label) of a source, with an optional augmentation drawn from
    the ambient RNG (plain DataLoader semantics: evaluation and stage-1 code; training's streams
    seed every sample's augmentation instead, pipeline.py)."""

    def __init__(self, source: ImageSource, transform: Optional[Transform] = None):
        self.source = source
        self.transform = transform

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int):
        batch = self.source.read(np.array([index], dtype=np.int64), self.transform, None)
        log_replaced_once(batch.replaced)
        return batch.images[0], int(batch.labels[0])


def tinyimages_record_count(path: str) -> int:
    if not os.path.isfile(path):
        raise DataError(f"80M TinyImages file {path} does not exist; put tiny_images.bin in "
                        "data.outdist_std_dir")
    size = os.path.getsize(path)
    if size == 0 or size % TINY_RECORD_BYTES:
        raise DataError(f"{path}: size {size} bytes is not a positive multiple of "
                        f"{TINY_RECORD_BYTES} (32x32x3 records); the file is truncated or not "
                        "tiny_images.bin")
    return size // TINY_RECORD_BYTES

