"""Input-normalisation statistics of the in-distribution datasets (docs/design.md §1).

A model normalises its input itself (`Classifier.normalize`) with the statistics of the dataset it
is trained on; they are constants of the data, never part of a state dict. No torch here: the
registry and config validation read them.
"""

from __future__ import annotations

from typing import Tuple

Stats = Tuple[Tuple[float, ...], Tuple[float, ...]]

# CIFAR-10 training-set statistics, to full precision; the original uses them for CIFAR-100 too.
CIFAR10_MEAN = (0.4913997551666284, 0.48215855929893703, 0.4465309133731618)
CIFAR10_STD = (0.24703225141799082, 0.24348516474564, 0.26158783926049628)
# Digits are grey images replicated to 3 channels by the data pipeline.
DIGITS_MEAN = (0.5, 0.5, 0.5)
DIGITS_STD = (0.5, 0.5, 0.5)
# ImageNet training-set statistics (timm's IMAGENET_DEFAULT_MEAN / _STD, the `robustness`
# library's normaliser), used by the ImageNet models.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def dataset_stats(indist_dataset: str) -> Stats:
    """(mean, std) used for input normalisation of a model trained on `indist_dataset`."""
    if indist_dataset == "digits":
        return DIGITS_MEAN, DIGITS_STD
    if indist_dataset.lower() == "imagenet":
        return IMAGENET_MEAN, IMAGENET_STD
    if indist_dataset.startswith("cifar") or indist_dataset == "imagefolder":
        return CIFAR10_MEAN, CIFAR10_STD
    raise ValueError(f"no normalisation statistics for data.indist_dataset '{indist_dataset}'")
