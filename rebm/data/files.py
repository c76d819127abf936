"""Datasets read from files: CIFAR-10/100 (torchvision's loader), scikit-learn's digits, image
folders and image tensor files, each as an image source (sources.py)."""

from __future__ import annotations

import importlib.util
import logging
import os
import pickle
from typing import List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision import datasets as tv_datasets
from torchvision.transforms.v2 import functional as TF

from rebm.data.sources import (
    IMAGE_EXTENSIONS,
    DataError,
    ImageFileSource,
    TensorSource,
    one_line,
)

LOGGER = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100 (real torchvision loader)
# --------------------------------------------------------------------------------------------
def _without_checksums(file_list: list) -> list:
    return [[name, None] for name, _ in file_list]


class _UncheckedCIFAR10(tv_datasets.CIFAR10):
    """torchvision's CIFAR-10 loader, unchanged, with its md5 checks replaced by existence checks
    (`check_integrity(path, None)`). Used only when the files exist but differ from the official
    release (a re-packed or test copy, e.g. rebm/standin/writers.py); the pickles are still read by
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


class _CifarUnpickler(pickle.Unpickler):
    """CIFAR batches hold dicts of bytes, lists and numpy arrays: nothing else is rebuilt, so a
    file that is not the official release cannot run code when it is read."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
               ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refused global {module}.{name}")
        return super().find_class(module, name)


def _find_corrupt_cifar_file(folder: str, names: Sequence[str]) -> Optional[tuple]:
    """(path, reason) of the first file in `names` that is not a plain CIFAR pickle (a dict of
    arrays, read without rebuilding any other object), else None."""
    for name in names:
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as f:
                entry = _CifarUnpickler(f, encoding="latin1").load()
            if not isinstance(entry, dict):
                return path, f"holds a {type(entry).__name__}, not a dict"
        except Exception as err:  # any unpickling failure means the file is unusable
            return path, one_line(err)
    return None


def cifar_archive(root: str, num_classes: int) -> tuple:
    """(the extracted folder under `root`, the names of its files, the archive's address) of
    CIFAR-10 or CIFAR-100."""
    cls = _CIFAR_CLASSES[num_classes][0]
    return os.path.join(root, cls.base_folder), _cifar_files(cls), cls.url


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
            f"could not download {label} into {folder} ({one_line(err)}); download "
            f"{cls.url} by hand and extract it into {root}"
        ) from None
    return _cifar_to_source(ds, folder, label, train)


def _load_unchecked_cifar(cls, root: str, train: bool, folder: str):
    """Files that are not the official release: checked with a restricted unpickler before
    torchvision's loader (which unpickles freely) ever reads them."""
    split_files = [n for n, _ in (cls.train_list if train else cls.test_list)]
    bad = _find_corrupt_cifar_file(folder, split_files + [cls.meta["filename"]])
    if bad is not None:
        raise DataError(
            f"{bad[0]}: corrupt CIFAR pickle ({bad[1]}); delete {folder} and re-extract "
            "the archive (or set data.download=true)"
        ) from None
    try:
        return cls(root=root, train=train, download=False)
    except Exception as err:
        raise DataError(f"{folder}: cannot load CIFAR ({one_line(err)}); re-extract the "
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


def _sklearn_digits() -> tuple:
    """(images (1797, 8, 8) float64, targets (1797,) int64): what sklearn.datasets.load_digits
    returns, read from the same file that scikit-learn ships (datasets/data/digits.csv.gz: 64
    pixel values and the label per row). Importing sklearn.datasets costs 1.3 s of CPU in every
    process that starts (a fifth of a quickstart rank's start-up); finding the package's folder
    does not import it."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("data.indist_dataset=digits needs scikit-learn (pip install scikit-learn)")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    rows = np.loadtxt(path, delimiter=",")
    return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(np.int64)


def load_digits(size: int, train: bool) -> TensorSource:
    """sklearn's 1797 8x8 digits: fixed split (permutation with seed 0, 80/20), values/16,
    bilinear resize to `size` once, stored as uint8 with 3 identical channels."""
    images, targets = _sklearn_digits()
    n = len(targets)
    order = np.random.default_rng(0).permutation(n)
    n_train = int(round(DIGITS_TRAIN_FRACTION * n))
    chosen = np.sort(order[:n_train] if train else order[n_train:])
    images = torch.from_numpy(images[chosen]).float().div(16.0).unsqueeze(1)
    if size != 8:
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    images = images.clamp(0, 1).mul(255).round().to(torch.uint8).expand(-1, 3, -1, -1)
    labels = torch.as_tensor(targets[chosen], dtype=torch.int64)
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
        raise DataError(f"image folder {root} holds no images ({one_line(err)}); put images in "
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
        raise DataError(f"{path}: cannot read image tensor file ({one_line(err)})") from None
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
        return array.float().contiguous().clamp_(0, 1)  # contiguous: an expanded grey channel
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
