"""ImageNet in torchvision's layout (meta.bin, train/, val/ under data.indist_ds_dir)."""

from __future__ import annotations

import os
from typing import List

from rebm.config import DataConfig
from rebm.config.datasets import InputFile, indist
from rebm.data.imagenet import IMAGENET_SPLITS, META_FILE, load_imagenet
from rebm.data.sources import ImageSource


def imagenet_files(data: DataConfig) -> List[InputFile]:
    """torchvision's layout: meta.bin and the train and val folders."""
    source = "set up ImageNet (image-net.org) in torchvision's layout there (docs/imagenet.md)"
    return [InputFile("data.indist_ds_dir", os.path.join(data.indist_ds_dir, name), source)
            for name in (META_FILE, *dict.fromkeys(IMAGENET_SPLITS.values()))]


# image_size 256: the original's data.image_size default, which none of its ImageNet configs
# overrides (rebm/config/original_defaults.py)
@indist("ImageNet", num_classes=1000, image_size=256, files=imagenet_files)
def imagenet(data: DataConfig, split: str) -> ImageSource:
    return load_imagenet(data.indist_ds_dir, split, data.image_size, data.num_classes)
