"""Image sources: CIFAR-10/100, scikit-learn digits, image folders, tensor files, 80M TinyImages,
procedural noise — and the one error type for bad data (`DataError`, a one-line message that
names the path and the fix).

A *source* is indexable storage that returns a batch of images for an array of indices:
`source.images(idx) -> (k, 3, S, S)` uint8 (or float in [0, 1]) at the configured image size, and
`source.labels(idx) -> (k,)` int64 (-1 where there are no classes). Samplers and augmentation
live elsewhere (sampling.py, augmentations.py); `ImageDataset` adapts a source to a torch
`Dataset` of (float image, label) for evaluation and stage-1 code.

Small sets (CIFAR: 50k x 3 x 32 x 32 uint8 = 150 MB) are decoded once into one tensor in memory;
TinyImages stays on disk (memory-mapped); image folders are decoded per access.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
from typing import List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision import datasets as tv_datasets
from torchvision.transforms.v2 import functional as TF

from rebm.errors import UserError
from rebm.training.augmentations import Transform, augment_batch
from rebm.training.sampling import PURPOSE_AUGMENT, sample_keys

LOGGER = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
TINY_RECORD_BYTES = 32 * 32 * 3
DEFAULT_NOISE_LENGTH = 50_000


class DataError(UserError, ValueError):
    """A data problem the user can fix; the message is one line naming the path and the fix."""


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------
class ImageSource:
    """Indexable image storage (see the module docstring)."""

    name = "images"

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
            raise DataError(f"{path}: cannot decode image ({_one_line(err)})") from None
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

    Optional exclusion (e.g. records that overlap CIFAR): a sorted array `excluded` of record
    numbers; virtual index v maps to record v + #{k : excluded[k] - k <= v} (binary search), so
    nothing proportional to the 80M records is ever materialised.
    """

    name = "tinyimages"

    def __init__(self, path: str, size: int, exclude_path: Optional[str] = None):
        self.path = path
        self.size = size
        self.num_records = _tinyimages_record_count(path)
        excluded = (
            _load_exclusion(exclude_path, self.num_records) if exclude_path
            else np.zeros(0, np.int64)
        )
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
    """(float [0, 1] CHW image, int label) of a source, with an optional augmentation.

    With `seed=None` the augmentation draws from the ambient RNG (plain DataLoader semantics).
    With a seed, sample i in epoch e is augmented from sample_keys(seed, stream, e, i) — call
    `set_epoch` every epoch, or every epoch repeats the same augmentations.
    """

    def __init__(self, source: ImageSource, transform: Optional[Transform] = None,
                 seed: Optional[int] = None, stream: str = "eval"):
        self.source = source
        self.transform = transform
        self.seed = seed
        self.stream = stream
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int):
        idx = np.array([index], dtype=np.int64)
        seeds = None
        if self.seed is not None:
            seeds = sample_keys(self.seed, self.stream, self.epoch, idx, PURPOSE_AUGMENT)
        image = augment_batch(self.source.images(idx), self.transform, seeds)[0]
        return image, int(self.source.labels(idx)[0])


# --------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100 (real torchvision loader)
# --------------------------------------------------------------------------------------------
def _without_checksums(file_list: list) -> list:
    return [[name, None] for name, _ in file_list]


class _UncheckedCIFAR10(tv_datasets.CIFAR10):
    """torchvision's CIFAR-10 loader, unchanged, with its md5 checks replaced by existence checks
    (`check_integrity(path, None)`). Used only when the files exist but differ from the official
    release (a re-packed or test copy, e.g. tests/fake_data.py); the pickles are still read by
    torchvision's own code."""

    train_list = _without_checksums(tv_datasets.CIFAR10.train_list)
    test_list = _without_checksums(tv_datasets.CIFAR10.test_list)
    meta = {**tv_datasets.CIFAR10.meta, "md5": None}


class _UncheckedCIFAR100(tv_datasets.CIFAR100):
    """As `_UncheckedCIFAR10`, for CIFAR-100."""

    train_list = _without_checksums(tv_datasets.CIFAR100.train_list)
    test_list = _without_checksums(tv_datasets.CIFAR100.test_list)
    meta = {**tv_datasets.CIFAR100.meta, "md5": None}


_CIFAR_CLASSES = {
    10: (tv_datasets.CIFAR10, _UncheckedCIFAR10, "CIFAR-10"),
    100: (tv_datasets.CIFAR100, _UncheckedCIFAR100, "CIFAR-100"),
}
_warned_unchecked: set = set()


def _cifar_files(cls) -> List[str]:
    return [name for name, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]


def _find_corrupt_cifar_file(folder: str, names: Sequence[str]) -> Optional[tuple]:
    """(path, reason) of the first file in `names` that is not a CIFAR pickle, else None."""
    for name in names:
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f, encoding="latin1")
            if not isinstance(entry, dict):
                return path, f"holds a {type(entry).__name__}, not a dict"
        except Exception as err:  # any unpickling failure means the file is unusable
            return path, _one_line(err)
    return None


def _check_cifar_present(cls, root: str, label: str) -> None:
    folder = os.path.join(root, cls.base_folder)
    missing = [n for n in _cifar_files(cls) if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        raise DataError(
            f"{label} not found: expected the extracted archive at {folder} (missing "
            f"{missing[0]}); set data.download=true to download it, or extract {cls.filename} "
            f"into {root}"
        )


def load_cifar(root: str, num_classes: int, train: bool, download: bool) -> TensorSource:
    """CIFAR-10/100 through torchvision (md5-verified). Files that exist but do not match the
    official checksums are loaded through the same torchvision code without the md5 check (one
    warning); unreadable pickles are a DataError naming the file."""
    cls, unchecked_cls, label = _CIFAR_CLASSES[num_classes]
    folder = os.path.join(root, cls.base_folder)
    if not download:
        _check_cifar_present(cls, root, label)
    try:
        ds = cls(root=root, train=train, download=download)
    except RuntimeError:  # torchvision: "Dataset not found or corrupted" (md5 mismatch)
        _check_cifar_present(cls, root, label)
        if folder not in _warned_unchecked:
            _warned_unchecked.add(folder)
            LOGGER.warning("%s: files differ from the official %s release (md5); loading them "
                           "anyway", folder, label)
        ds = _load_unchecked_cifar(unchecked_cls, root, train, folder)
    except DataError:
        raise
    except Exception as err:  # download failures (no network, disk full, ...)
        raise DataError(
            f"could not download {label} into {folder} ({_one_line(err)}); download "
            f"{cls.url} by hand and extract it into {root}"
        ) from None
    return _cifar_to_source(ds, folder, label, train)


def _load_unchecked_cifar(cls, root: str, train: bool, folder: str):
    try:
        return cls(root=root, train=train, download=False)
    except Exception as err:
        split_files = [n for n, _ in (cls.train_list if train else cls.test_list)]
        bad = _find_corrupt_cifar_file(folder, split_files + [cls.meta["filename"]])
        if bad is not None:
            raise DataError(
                f"{bad[0]}: corrupt CIFAR pickle ({bad[1]}); delete {folder} and re-extract "
                "the archive (or set data.download=true)"
            ) from None
        raise DataError(f"{folder}: cannot load CIFAR ({_one_line(err)}); re-extract the "
                        "archive") from None


def _cifar_to_source(ds, folder: str, label: str, train: bool) -> TensorSource:
    images = torch.from_numpy(np.ascontiguousarray(ds.data)).permute(0, 3, 1, 2).contiguous()
    labels = torch.as_tensor(ds.targets, dtype=torch.int64)
    if labels.shape[0] != images.shape[0]:
        raise DataError(f"{folder}: {images.shape[0]} images but {labels.shape[0]} labels; "
                        "re-extract the archive")
    split = "train" if train else "test"
    return TensorSource(images, labels, f"{label} {split}")


# --------------------------------------------------------------------------------------------
# Digits (scikit-learn, bundled — no download)
# --------------------------------------------------------------------------------------------
DIGITS_TRAIN_FRACTION = 0.8


def load_digits(size: int, train: bool) -> TensorSource:
    """sklearn's 1797 8x8 digits: fixed split (permutation with seed 0, 80/20), values/16,
    bilinear resize to `size` once, stored as uint8 with 3 identical channels."""
    from sklearn.datasets import load_digits as sk_load_digits

    digits = sk_load_digits()
    n = len(digits.target)
    order = np.random.default_rng(0).permutation(n)
    n_train = int(round(DIGITS_TRAIN_FRACTION * n))
    chosen = np.sort(order[:n_train] if train else order[n_train:])
    images = torch.from_numpy(digits.images[chosen]).float().div(16.0).unsqueeze(1)
    if size != 8:
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    images = images.clamp(0, 1).mul(255).round().to(torch.uint8).expand(-1, 3, -1, -1)
    labels = torch.as_tensor(digits.target[chosen], dtype=torch.int64)
    return TensorSource(images.contiguous(), labels, f"digits {'train' if train else 'test'}")


# --------------------------------------------------------------------------------------------
# Image folders
# --------------------------------------------------------------------------------------------
def load_labelled_folder(root: str, size: int) -> ImageFileSource:
    """torchvision ImageFolder layout (root/<class>/<image>); decoded on access."""
    if not os.path.isdir(root):
        raise DataError(f"image folder {root} does not exist; create root/<class>/<image> "
                        "(train/ and test/ under data.indist_ds_dir)")
    try:
        folder = tv_datasets.ImageFolder(root)
    except (FileNotFoundError, OSError) as err:
        raise DataError(f"image folder {root} holds no images ({_one_line(err)}); put images in "
                        "class sub-folders root/<class>/<image>") from None
    files = [path for path, _ in folder.samples]
    labels = [target for _, target in folder.samples]
    return ImageFileSource(files, labels, size, f"imagefolder {root}")


def list_image_files(root: str) -> List[str]:
    """All image files under root (recursively, sorted) — flat folders and class folders alike."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames.sort()
        found += [os.path.join(dirpath, f) for f in sorted(filenames)
                  if f.lower().endswith(IMAGE_EXTENSIONS)]
    return found


def load_unlabelled_folder(root: str, size: int) -> ImageFileSource:
    if not os.path.isdir(root):
        raise DataError(f"image folder {root} does not exist; set data.outdist_std_dir to a "
                        "folder of images")
    files = list_image_files(root)
    if not files:
        raise DataError(f"image folder {root} holds no images ({', '.join(IMAGE_EXTENSIONS)}); "
                        "set data.outdist_std_dir to a folder of images")
    return ImageFileSource(files, None, size, f"imagefolder {root}")


# --------------------------------------------------------------------------------------------
# Tensor files (.pt / .npz / .npy)
# --------------------------------------------------------------------------------------------
_ARRAY_KEYS = ("images", "x", "data", "imgs", "samples", "arr_0")


def _pick_array(items: dict, path: str):
    if len(items) == 1:
        return next(iter(items.values()))
    for key in _ARRAY_KEYS:
        if key in items:
            return items[key]
    raise DataError(f"{path}: several arrays ({', '.join(map(str, items))}) and none named "
                    f"{'/'.join(_ARRAY_KEYS)}; save the images under one of those keys")


def _read_array_file(path: str) -> Tensor:
    if not os.path.isfile(path):
        raise DataError(f"image tensor file {path} does not exist")
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".npy":
            return torch.from_numpy(np.load(path, allow_pickle=False))
        if ext == ".npz":
            with np.load(path, allow_pickle=False) as npz:
                return torch.from_numpy(np.asarray(_pick_array(dict(npz.items()), path)))
        if ext in (".pt", ".pth"):
            obj = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(obj, dict):
                obj = _pick_array(obj, path)
            if not isinstance(obj, Tensor):
                raise DataError(f"{path}: holds a {type(obj).__name__}, not an image tensor")
            return obj
    except DataError:
        raise
    except Exception as err:
        raise DataError(f"{path}: cannot read image tensor file ({_one_line(err)})") from None
    raise DataError(f"{path}: unsupported extension '{ext}'; use .pt, .npz or .npy")


def _to_nchw(array: Tensor, path: str) -> Tensor:
    if array.ndim == 3:  # (N, H, W) greyscale
        array = array.unsqueeze(1)
    if array.ndim != 4:
        raise DataError(f"{path}: images must be (N, C, H, W) or (N, H, W, C), got shape "
                        f"{tuple(array.shape)}")
    if array.shape[1] not in (1, 3) and array.shape[3] in (1, 3):
        array = array.permute(0, 3, 1, 2)
    if array.shape[1] not in (1, 3):
        raise DataError(f"{path}: cannot find a channel axis of size 1 or 3 in shape "
                        f"{tuple(array.shape)}")
    return array.expand(-1, 3, -1, -1) if array.shape[1] == 1 else array


def _check_values(array: Tensor, path: str) -> Tensor:
    """uint8 stays uint8; floats must lie in [0, 1]; integers in [0, 255] become uint8."""
    if array.dtype == torch.uint8:
        return array
    if array.is_floating_point():
        lo, hi = (float(array.min()), float(array.max())) if array.numel() else (0.0, 0.0)
        if lo < -1e-4 or hi > 1 + 1e-4:
            raise DataError(f"{path}: float images must lie in [0, 1], found [{lo:.3g}, "
                            f"{hi:.3g}]; divide by 255 or save as uint8")
        return array.float().clamp_(0, 1)
    if array.dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        if array.numel() and (int(array.min()) < 0 or int(array.max()) > 255):
            raise DataError(f"{path}: integer images must lie in [0, 255]")
        return array.to(torch.uint8)
    raise DataError(f"{path}: unsupported dtype {array.dtype}; use uint8 or float in [0, 1]")


def load_image_array(path: str) -> Tensor:
    """A .pt/.npz/.npy image file as an (N, 3, H, W) tensor, uint8 or float [0, 1]."""
    return _check_values(_to_nchw(_read_array_file(path), path), path).contiguous()


def image_tensor_file(path: str) -> Tensor:
    """Load .pt/.npz/.npy images, (N, C, H, W) or (N, H, W, C), uint8 or float in [0, 1] (one or
    three channels) -> float32 [0, 1] (N, 3, H, W). Anything else is a DataError naming the path."""
    images = load_image_array(path)
    return images.float().div_(255.0) if images.dtype == torch.uint8 else images.float()


def load_tensor_file(path: str, size: int) -> TensorSource:
    images = load_image_array(path)
    if images.shape[0] == 0:
        raise DataError(f"{path}: holds no images")
    if images.shape[-2:] != (size, size):
        images = TF.resize(images, [size, size], antialias=True)
    return TensorSource(images, None, f"tensorfile {path}")


# --------------------------------------------------------------------------------------------
# TinyImages helpers
# --------------------------------------------------------------------------------------------
def _tinyimages_record_count(path: str) -> int:
    if not os.path.isfile(path):
        raise DataError(f"80M TinyImages file {path} does not exist; put tiny_images.bin in "
                        "data.outdist_std_dir")
    size = os.path.getsize(path)
    if size == 0 or size % TINY_RECORD_BYTES:
        raise DataError(f"{path}: size {size} bytes is not a positive multiple of "
                        f"{TINY_RECORD_BYTES} (32x32x3 records); the file is truncated or not "
                        "tiny_images.bin")
    return size // TINY_RECORD_BYTES


def _load_exclusion(path: str, num_records: int) -> np.ndarray:
    """Sorted unique 0-based record numbers to skip, from a .npy or a whitespace text file."""
    if not os.path.isfile(path):
        raise DataError(f"exclusion index {path} does not exist (data.outdist_exclude_index)")
    try:
        if path.lower().endswith(".npy"):
            values = np.load(path, allow_pickle=False)
        else:
            values = np.loadtxt(path, dtype=np.int64, ndmin=1, comments="#")
    except Exception as err:
        raise DataError(f"{path}: cannot read exclusion index ({_one_line(err)}); use a .npy "
                        "or a text file of integers") from None
    values = np.unique(np.asarray(values, dtype=np.int64).ravel())
    if values.size and (values[0] < 0 or values[-1] >= num_records):
        raise DataError(f"{path}: record numbers must lie in [0, {num_records}) (0-based), found "
                        f"[{values[0]}, {values[-1]}]; a 1-based list (like the original "
                        "80mn_cifar_idxs.txt) needs 1 subtracted")
    return values
