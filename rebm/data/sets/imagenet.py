"""ImageNet in torchvision's layout (meta.bin, train/, val/ under data.indist_ds_dir)."""

from __future__ import annotations

from rebm.config import DataConfig
from rebm.config.datasets import indist
from rebm.data.imagenet import load_imagenet
from rebm.data.sources import ImageSource


# image_size 256: the original's data.image_size default, which none of its ImageNet configs
# overrides (rebm/config/original_defaults.py)
@indist("ImageNet", num_classes=1000, image_size=256)
def imagenet(data: DataConfig, split: str) -> ImageSource:
    return load_imagenet(data.indist_ds_dir, split, data.image_size, data.num_classes)
