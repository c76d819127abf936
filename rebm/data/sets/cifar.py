"""CIFAR-10 and CIFAR-100 (torchvision's files under data.indist_ds_dir); `-conditional` are the
original's names of the same data (the class-conditional EBM reads the labels either way)."""

from __future__ import annotations

from torchvision.transforms.v2 import functional as TF

from rebm.config import DataConfig
from rebm.config.datasets import indist
from rebm.data.files import load_cifar
from rebm.data.sources import TensorSource


@indist("cifar100-conditional", num_classes=100)
@indist("cifar100", num_classes=100)
@indist("cifar10-conditional", num_classes=10)
@indist("cifar10", num_classes=10)
def cifar(data: DataConfig, split: str) -> TensorSource:
    classes = 100 if "100" in data.indist_dataset else 10
    source = load_cifar(data.indist_ds_dir, classes, split == "train", data.download)
    if data.image_size != 32:  # resized once here, not per sample
        source.data = TF.resize(source.data, [data.image_size] * 2, antialias=True)
    return source
