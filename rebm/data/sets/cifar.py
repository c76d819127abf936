"""CIFAR-10 and CIFAR-100 (torchvision's files under data.indist_ds_dir); `-conditional` are the
original's names of the same data (the class-conditional EBM reads the labels either way)."""

from __future__ import annotations

import os
from typing import List

from torchvision.transforms.v2 import functional as TF

from rebm.config import DataConfig
from rebm.config.datasets import InputFile, indist
from rebm.data.files import cifar_archive, load_cifar
from rebm.data.sources import TensorSource


def _classes(data: DataConfig) -> int:
    return 100 if "100" in data.indist_dataset else 10


def cifar_files(data: DataConfig) -> List[InputFile]:
    """The extracted archive's files (both splits and the meta file: the run's evaluations read
    the test split); none with data.download, which fetches what is missing."""
    if data.download:
        return []
    folder, names, url = cifar_archive(data.indist_ds_dir, _classes(data))
    source = (f"set data.download=true to download it, or extract {url} into "
              f"{data.indist_ds_dir}")
    return [InputFile("data.indist_ds_dir", os.path.join(folder, name), source)
            for name in names]


@indist("cifar100-conditional", num_classes=100, files=cifar_files)
@indist("cifar100", num_classes=100, files=cifar_files)
@indist("cifar10-conditional", num_classes=10, files=cifar_files)
@indist("cifar10", num_classes=10, files=cifar_files)
def cifar(data: DataConfig, split: str) -> TensorSource:
    classes = _classes(data)
    source = load_cifar(data.indist_ds_dir, classes, split == "train", data.download)
    if data.image_size != 32:  # resized once here, not per sample
        source.data = TF.resize(source.data, [data.image_size] * 2, antialias=True)
    return source
