"""scikit-learn's bundled 8x8 digits (the quickstart's data): no folder to read."""

from __future__ import annotations

from rebm.config import DataConfig
from rebm.config.datasets import indist
from rebm.data.files import load_digits
from rebm.data.sources import TensorSource


@indist("digits", reads_files=False, num_classes=10)
def digits(data: DataConfig, split: str) -> TensorSource:
    return load_digits(data.image_size, split == "train")
