"""80M TinyImages: tiny_images.bin (data.outdist_std_dir, the file or its folder), read through a
memory map, optionally without the records of data.outdist_exclude_index."""

from __future__ import annotations

import os

from rebm.config.datasets import outdist
from rebm.config.sections import InputSection
from rebm.data.sources import TinyImagesSource

TINYIMAGES_FILE = "tiny_images.bin"


@outdist("80m-tinyimages")
@outdist("tinyimages")
def tinyimages(inputs: InputSection, _length) -> TinyImagesSource:
    path = inputs.data.outdist_std_dir
    if os.path.isdir(path):
        path = os.path.join(path, TINYIMAGES_FILE)
    return TinyImagesSource(path, inputs.data.image_size, inputs.data.outdist_exclude_index)
