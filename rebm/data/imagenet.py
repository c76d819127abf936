"""ImageNet (torchvision's on-disk layout) and OpenImage-O (an image folder): image files decoded
at full resolution on access — in the DataLoader workers during training — and brought to
data.image_size by the sample's own (seeded) augmentation.

Unreadable files (corrupt, truncated, not an image): a multi-day run must not die on one bad
JPEG, and its replacement must not depend on the world size (exact resume, 1 rank = N ranks).
Index i whose file cannot be decoded is replaced by the next readable index i+1, i+2, ...
(mod n) — a function of i alone — and augmented with i's own seed. Each read reports the files
it replaced (`SourceBatch.replaced`): training counts them in `MicroBatch.replaced` and logs
each file once per rank (pipeline.py); evaluation logs them once per process.

File lists: ImageNet has 1.28M training files, so the paths are kept as one byte buffer plus
offsets (`PathTable`), not a list of Python strings: cheap to send to spawned workers and no
copy-on-write of a million refcounted objects in forked ones.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor
from torchvision import datasets as tv_datasets
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from rebm.data.augmentations import (
    FullImageTransform,
    Transform,
    imagenet_augmentation,
    single_threaded,
    to_float01,
)
from rebm.data.sources import DataError, ImageSource, SourceBatch, one_line

META_FILE = "meta.bin"
IMAGENET_SPLITS = {"train": "train", "test": "val"}  # rebm's split name -> ImageNet folder
OPENIMAGES_SUBSET_SEED = 42  # the original's seed of the openimages_max_samples subset
MAX_CONSECUTIVE_BAD = 64  # give up (a broken copy, not a few bad files) after this many
# (split folder, its mtime) -> (files, labels): training, evaluation and generation each ask for
# the split; scanning 1.28M files once per process is enough
_SCANS: Dict[Tuple[str, float], tuple] = {}


class PathTable:
    """An immutable sequence of file paths under one root, stored as one uint8 buffer."""

    def __init__(self, root: str, paths: Sequence[str]):
        self.root = root
        encoded = [os.fsencode(os.path.relpath(p, root)) for p in paths]
        self.ends = np.cumsum([len(e) for e in encoded], dtype=np.int64)
        self.blob = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, index: int) -> str:
        start = int(self.ends[index - 1]) if index > 0 else 0
        rel = os.fsdecode(self.blob[start:int(self.ends[index])].tobytes())
        return os.path.join(self.root, rel)


def decode_rgb(path: str):
    """The RGB PIL image of a file at full resolution, or None if it cannot be decoded."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            img.load()  # a truncated JPEG raises here (PIL does not load truncated images)
            return img.convert("RGB")
    except Exception:  # noqa: BLE001 - any decoder failure is "unreadable": replaced, counted
        return None


class FullImageSource(ImageSource):
    """Image files decoded at full resolution per access; see the module docstring.

    `images(idx)` (uint8, e.g. for fitting the Gaussian of generation) applies the fixed
    evaluation resize (`test`); `read(idx, transform, seeds)` applies the sample's transform to
    the decoded file (a FullImageTransform), or the `test` resize and then the transform (the
    CIFAR-style augmentations, which expect image_size x image_size)."""

    full_images = True

    def __init__(self, files: PathTable, labels: Optional[np.ndarray], size: int, name: str):
        self.files = files
        self.targets = None if labels is None else torch.as_tensor(labels, dtype=torch.int64)
        self.size = size
        self.name = name
        self.fixed = imagenet_augmentation("test", size)

    def __len__(self) -> int:
        return len(self.files)

    def labels(self, indices: np.ndarray) -> Tensor:
        if self.targets is None:
            return super().labels(indices)
        return self.targets[torch.as_tensor(np.asarray(indices, dtype=np.int64))]

    def decode(self, index: int) -> tuple:
        """(index actually read, PIL image, paths of unreadable files skipped on the way)."""
        bad: List[str] = []
        for step in range(min(MAX_CONSECUTIVE_BAD, len(self))):
            candidate = (int(index) + step) % len(self)
            image = decode_rgb(self.files[candidate])
            if image is not None:
                return candidate, image, bad
            bad.append(self.files[candidate])
        raise DataError(f"{self.name}: {len(bad)} consecutive files from {bad[0]} cannot be "
                        "decoded; the copy is broken: re-extract or re-download it")

    def _apply(self, image, transform: Optional[Transform]) -> Tensor:
        if not isinstance(transform, FullImageTransform):  # fixed resize first, to a tensor
            image = self.fixed(image)
        return image if transform is None else transform(image)

    def read(self, indices: np.ndarray, transform: Optional[Transform],
             seeds: Optional[Sequence[int]]) -> SourceBatch:
        used, images, replaced = [], [], []
        # seeded: restore the caller's RNG afterwards; unseeded: draw from (and advance) it
        keep_rng = torch.random.fork_rng(devices=[]) if seeds is not None else nullcontext()
        with single_threaded(), keep_rng:
            for pos, index in enumerate(np.asarray(indices, dtype=np.int64)):
                read_index, image, bad = self.decode(int(index))
                used.append(read_index)
                replaced += bad
                if seeds is not None:
                    torch.default_generator.manual_seed(int(seeds[pos]))
                images.append(self._apply(image, transform))
        if not images:
            return SourceBatch(torch.zeros(0, 3, self.size, self.size), self.labels(used))
        return SourceBatch(to_float01(torch.stack(images)),
                           self.labels(np.asarray(used, dtype=np.int64)), tuple(replaced))

    def images(self, indices: np.ndarray) -> Tensor:
        with single_threaded():
            return torch.stack([self.fixed(self.decode(int(i))[1]) for i in indices])


# --------------------------------------------------------------------------------------------
# ImageNet (torchvision layout)
# --------------------------------------------------------------------------------------------
def _check_imagenet_layout(root: str, folder: str) -> None:
    where = "set data.indist_ds_dir to the folder that holds meta.bin, train/ and val/"
    if not os.path.isdir(root):
        raise DataError(f"ImageNet root {root} does not exist; {where} (docs/data.md)")
    meta = os.path.join(root, META_FILE)
    if not os.path.isfile(meta):
        raise DataError(f"{meta} is missing; let torchvision write it once: put "
                        f"ILSVRC2012_devkit_t12.tar.gz in {root} and run python -c \"import "
                        f"torchvision; torchvision.datasets.ImageNet('{root}', split='val')\" "
                        "(docs/data.md)")
    split_dir = os.path.join(root, folder)
    if not os.path.isdir(split_dir):
        raise DataError(f"ImageNet split folder {split_dir} does not exist; put the {folder} "
                        f"images in {split_dir}/<wnid>/<image>.JPEG (torchvision extracts "
                        f"ILSVRC2012_img_{folder}.tar there; docs/data.md)")


def load_imagenet(root: str, split: str, size: int, num_classes: int) -> FullImageSource:
    """ImageNet's `split` ("train" or "test" = val/) read through torchvision's own parser:
    meta.bin (loaded with weights_only=True: no arbitrary unpickling) and class folders named
    by wnid, numbered in sorted wnid order."""
    folder = IMAGENET_SPLITS[split]
    _check_imagenet_layout(root, folder)
    split_dir = os.path.join(root, folder)
    key = (os.path.abspath(split_dir), os.path.getmtime(split_dir))
    if key not in _SCANS:
        _SCANS[key] = _scan_imagenet(root, folder)
    files, labels = _SCANS[key]
    classes = int(labels.max()) + 1 if len(labels) else 0
    if classes != num_classes:
        raise DataError(f"{split_dir}: {classes} class folders but data.num_classes is "
                        f"{num_classes}; set data.num_classes={classes} or point "
                        "data.indist_ds_dir at a complete copy (ImageNet has 1000)")
    return FullImageSource(files, labels, size, f"ImageNet {folder}")


def _scan_imagenet(root: str, folder: str) -> tuple:
    split_dir = os.path.join(root, folder)
    try:
        dataset = tv_datasets.ImageNet(root, split=folder)
    except KeyError as err:
        raise DataError(f"{split_dir}: class folder {err} is not a wnid of "
                        f"{os.path.join(root, META_FILE)}; remove it or regenerate meta.bin"
                        ) from None
    except Exception as err:  # noqa: BLE001 - torchvision's errors, one line each
        raise DataError(f"{split_dir}: cannot read ImageNet ({one_line(err)}); expected "
                        f"{split_dir}/<wnid>/<image>.JPEG and a meta.bin written by "
                        "torchvision") from None
    files = PathTable(split_dir, [path for path, _ in dataset.samples])
    labels = np.fromiter((target for _, target in dataset.samples), dtype=np.int64,
                         count=len(dataset.samples))
    return files, labels


# --------------------------------------------------------------------------------------------
# OpenImage-O (image folder)
# --------------------------------------------------------------------------------------------
def openimages_files(root: str) -> List[str]:
    """Image files of root in torchvision ImageFolder's order (class folders sorted, each walked
    in sorted order), so `openimages_max_samples` picks the original's subset; a folder with
    no sub-folders: its own images, sorted."""
    classes, class_to_idx = find_classes(root) if _has_subfolders(root) else ([], {})
    if classes:
        samples = make_dataset(root, class_to_idx, extensions=IMG_EXTENSIONS, allow_empty=True)
        return [path for path, _ in samples]
    return sorted(os.path.join(root, name) for name in os.listdir(root)
                  if name.lower().endswith(IMG_EXTENSIONS))


def _has_subfolders(root: str) -> bool:
    return any(entry.is_dir() for entry in os.scandir(root))


def load_openimage_o(root: str, size: int, max_samples: Optional[int]) -> FullImageSource:
    """OpenImage-O out-distribution images; with `max_samples` below the folder's count, the
    fixed subset torch.randperm(n, seed 42)[:max_samples] (as the original)."""
    if not os.path.isdir(root):
        raise DataError(f"OpenImage-O folder {root} does not exist; set data.outdist_std_dir to "
                        "the folder of OpenImage-O images (docs/data.md)")
    files = openimages_files(root)
    if not files:
        raise DataError(f"OpenImage-O folder {root} holds no images ({', '.join(IMG_EXTENSIONS)})"
                        "; set data.outdist_std_dir to the folder of OpenImage-O images")
    if max_samples is not None and max_samples < len(files):
        generator = torch.Generator().manual_seed(OPENIMAGES_SUBSET_SEED)
        keep = torch.randperm(len(files), generator=generator)[:max_samples].tolist()
        files = [files[i] for i in keep]
    return FullImageSource(PathTable(root, files), None, size, f"OpenImage-O {root}")
