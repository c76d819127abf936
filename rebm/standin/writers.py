"""Stand-in datasets written in the real on-disk formats, so the real loaders read them: the
stand-in recipe runs (`python -m rebm.standin`) and the tests write their data with these.

- `write_fake_cifar10(root)`: `root/cifar-10-batches-py/{data_batch_1..5, test_batch,
  batches.meta}` — pickled dicts with `data` (N x 3072 uint8, channel-major rows), `labels`,
  `filenames`, `batch_label`, exactly the layout of the official archive, so
  `torchvision.datasets.CIFAR10(root, download=False)` reads them (its md5 check fails on them, so
  rebm loads them through torchvision's loader with the checksum replaced by an existence check;
  see rebm/data/files.py).
- `write_fake_cifar100(root)`: `root/cifar-100-python/{train, test, meta}` with `fine_labels` /
  `coarse_labels`.
- `write_image_folder`, `write_tiny_images` (and `write_tinyimages_exclusion_lists`),
  `write_tensor_file` for the other sources.
- `write_fake_imagenet(root)`: torchvision's ImageNet layout — `root/meta.bin` (torch.save of
  (wnid -> class names, val wnids), as torchvision's devkit parser writes it) and
  `root/{train,val}/<wnid>/*.JPEG`; `write_fake_openimage_o(root)`: a folder of JPEGs;
  `truncate_file(path)` cuts a JPEG in half (a corrupt file as met in a long run).
- `write_robustness_checkpoint(path, model)`: a public robust ImageNet checkpoint in the layout
  the `robustness` library saves.

Images are random noise with a per-class colour offset (so they are not all alike).
"""

from __future__ import annotations

import os
import pickle
from typing import List, Optional

import numpy as np

CIFAR10_LABEL_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                       "ship", "truck"]


def _fake_images(n: int, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(n, 3072) uint8 rows: channel-major 32x32x3 like CIFAR's `data` arrays."""
    noise = rng.integers(0, 200, size=(n, 3, 32, 32), dtype=np.int64)
    tint = (labels[:, None] * np.array([23, 57, 91])[None, :]) % 56  # per-class colour
    images = noise + tint[:, :, None, None]
    return images.astype(np.uint8).reshape(n, 3072)


def _dump(path: str, obj: dict) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)  # the official files are Python-2 pickles


def write_fake_cifar10(root: str, n_train: int = 500, n_test: int = 101, seed: int = 0) -> str:
    """Write a tiny CIFAR-10 (n_train split over 5 batches); returns the batch folder."""
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(folder, exist_ok=True)
    per_batch = np.array_split(np.arange(n_train), 5)
    for number, chunk in enumerate(per_batch, start=1):
        labels = rng.integers(0, 10, size=len(chunk))
        _dump(os.path.join(folder, f"data_batch_{number}"), {
            "batch_label": f"training batch {number} of 5",
            "labels": labels.tolist(),
            "data": _fake_images(len(chunk), labels, rng),
            "filenames": [f"train_{i}.png" for i in chunk],
        })
    labels = rng.integers(0, 10, size=n_test)
    _dump(os.path.join(folder, "test_batch"), {
        "batch_label": "testing batch 1 of 1",
        "labels": labels.tolist(),
        "data": _fake_images(n_test, labels, rng),
        "filenames": [f"test_{i}.png" for i in range(n_test)],
    })
    _dump(os.path.join(folder, "batches.meta"), {
        "num_cases_per_batch": max(len(c) for c in per_batch),
        "label_names": CIFAR10_LABEL_NAMES,
        "num_vis": 3072,
    })
    return folder


def write_fake_cifar100(root: str, n_train: int = 300, n_test: int = 50, seed: int = 0) -> str:
    """Write a tiny CIFAR-100; returns the folder."""
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, "cifar-100-python")
    os.makedirs(folder, exist_ok=True)
    for name, n in (("train", n_train), ("test", n_test)):
        fine = rng.integers(0, 100, size=n)
        _dump(os.path.join(folder, name), {
            "filenames": [f"{name}_{i}.png" for i in range(n)],
            "batch_label": f"{name}ing batch 1 of 1",
            "fine_labels": fine.tolist(),
            "coarse_labels": (fine // 5).tolist(),
            "data": _fake_images(n, fine, rng),
        })
    _dump(os.path.join(folder, "meta"), {
        "fine_label_names": [f"fine_{i}" for i in range(100)],
        "coarse_label_names": [f"coarse_{i}" for i in range(20)],
    })
    return folder


def write_image_folder(root: str, n_per_class: int = 3, classes: Optional[List[str]] = None,
                       size: int = 20, seed: int = 0) -> str:
    """root/<class>/<i>.png RGB images (non-square sizes are fine too)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for cls in classes or ["a", "b"]:
        os.makedirs(os.path.join(root, cls), exist_ok=True)
        for i in range(n_per_class):
            pixels = rng.integers(0, 256, size=(size, size + 4, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(os.path.join(root, cls, f"{i}.png"))
    return root


def write_tiny_images(path: str, n_records: int, seed: int = 0) -> np.ndarray:
    """A TinyImages-format file of random records; returns the images as (n, 3, 32, 32) CHW."""
    rng = np.random.default_rng(seed)
    chw = rng.integers(0, 256, size=(n_records, 3, 32, 32), dtype=np.uint8)
    # stored per record as reshape(32, 32, 3, order="F") of HWC, i.e. channel, column, row
    records = chw.transpose(0, 1, 3, 2).reshape(n_records, 3072)
    records.tofile(path)
    return chw


def write_tinyimages_exclusion_lists(folder: str, n_records: int, seed: int = 0) -> np.ndarray:
    """The original's six exclusion lists (their names; 80mn_cifar_idxs.txt counted from 1, the
    others from 0) for a file of `n_records`, one number per line, with duplicates and overlaps
    between lists as in the real ones; returns the records they exclude, 0-based and sorted."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    one_based = np.concatenate([[1, n_records, 1], rng.integers(1, n_records + 1, n_records // 8)])
    zero_based = {name: rng.integers(0, n_records, n_records // 20) for name in (
        "80mn_cifar10_test_idxs.txt", "80mn_cifar100_test_idxs.txt",
        "80mn_cifar10_train_idxs.txt", "80mn_cifar100_train_idxs.txt", "80mn_cifar101_idxs.txt")}
    zero_based["80mn_cifar10_test_idxs.txt"][:2] = [0, one_based[3] - 1]  # shared with the 1-based
    for name, values in {"80mn_cifar_idxs.txt": one_based, **zero_based}.items():
        with open(os.path.join(folder, name), "w") as f:
            f.writelines(f"{int(v)}\n" for v in values)
    return np.unique(np.concatenate([one_based - 1, *zero_based.values()]))


def write_tensor_file(path: str, n: int = 40, layout: str = "NHWC", seed: int = 0) -> np.ndarray:
    """uint8 images in .npy/.npz/.pt; returns them as (n, 3, 32, 32)."""
    rng = np.random.default_rng(seed)
    chw = rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)
    array = chw.transpose(0, 2, 3, 1) if layout == "NHWC" else chw
    if path.endswith(".npy"):
        np.save(path, array)
    elif path.endswith(".npz"):
        np.savez(path, images=array)
    else:
        import torch

        torch.save(torch.from_numpy(np.ascontiguousarray(array)), path)
    return chw


def _jpeg(path: str, rng: np.random.Generator, height: int, width: int, tint: int) -> None:
    """A smooth random JPEG (blocks, upsampled) so that JPEG compression keeps it recognisable."""
    from PIL import Image

    blocks = rng.integers(0, 200, size=(max(1, height // 8), max(1, width // 8), 3))
    blocks = (blocks + tint) % 256
    image = Image.fromarray(blocks.astype(np.uint8)).resize((width, height), Image.BILINEAR)
    image.save(path, format="JPEG", quality=90)


def imagenet_wnids(num_classes: int) -> List[str]:
    return [f"n{1440764 + 17 * i:08d}" for i in range(num_classes)]


def write_fake_imagenet(root: str, num_classes: int = 3, n_train: int = 4, n_val: int = 2,
                        height: int = 48, width: int = 64, seed: int = 0) -> str:
    """A tiny ImageNet in torchvision's on-disk layout (n_train / n_val JPEGs per class, of
    height x width, names like the real ones); returns root."""
    import torch

    rng = np.random.default_rng(seed)
    wnids = imagenet_wnids(num_classes)
    os.makedirs(root, exist_ok=True)
    wnid_to_classes = {wnid: (f"class {i}", f"alias {i}") for i, wnid in enumerate(wnids)}
    val_wnids = [wnid for wnid in wnids for _ in range(n_val)]
    torch.save((wnid_to_classes, val_wnids), os.path.join(root, "meta.bin"))
    counter = 0
    for split, per_class in (("train", n_train), ("val", n_val)):
        for label, wnid in enumerate(wnids):
            os.makedirs(os.path.join(root, split, wnid), exist_ok=True)
            for i in range(per_class):
                counter += 1
                name = (f"{wnid}_{i}.JPEG" if split == "train"
                        else f"ILSVRC2012_val_{counter:08d}.JPEG")
                _jpeg(os.path.join(root, split, wnid, name), rng, height, width, 40 * label)
    return root


def write_fake_openimage_o(root: str, n: int = 10, height: int = 40, width: int = 56,
                           seed: int = 1) -> str:
    """A flat folder of n JPEGs (OpenImage-O style); returns root."""
    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    for i in range(n):
        _jpeg(os.path.join(root, f"{i:06x}.jpg"), rng, height, width, 0)
    return root


def truncate_file(path: str) -> None:
    """Cut a file to half its size (a truncated JPEG)."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def write_robustness_checkpoint(path, model, mean=None, std=None):
    """The layout `robustness.train` saves: the AttackerModel's state dict under DataParallel,
    with the network twice (model, attacker.model) and two normalisers (ImageNet's statistics
    by default), plus training extras; returns path."""
    import torch

    from rebm.models.stats import IMAGENET_MEAN, IMAGENET_STD

    new_mean, new_std = (torch.tensor(v).view(3, 1, 1)
                         for v in (mean or IMAGENET_MEAN, std or IMAGENET_STD))
    sd = {"module.normalizer.new_mean": new_mean, "module.normalizer.new_std": new_std,
          "module.attacker.normalize.new_mean": new_mean.clone(),
          "module.attacker.normalize.new_std": new_std.clone()}
    for k, v in model.state_dict().items():
        sd["module.model." + k] = v.clone()
        sd["module.attacker.model." + k] = v.clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.save({"model": sd, "optimizer": opt.state_dict(), "schedule": None, "epoch": 90}, path)
    return path


def write_fake_svhn(root: str, n: int, split: str = "train", seed: int = 0) -> str:
    """`<root>/<split>_32x32.mat` as the official files hold it: X (32, 32, 3, N) uint8 and
    y (N, 1) with label 10 for the digit 0."""
    from scipy.io import savemat

    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    x = rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8)
    y = rng.integers(1, 11, size=(n, 1)).astype(np.uint8)
    path = os.path.join(root, f"{split}_32x32.mat")
    savemat(path, {"X": x, "y": y})
    return path
