"""The per-class reference statistics of the counterfactual FID: one .npz (mu, sigma) per class
of that class's images, by default of the training split like the original's reference folders
(./datasets/cifar10_images_by_classes/train/<c>). Its command line is
`python -m rebm.eval.counterfactuals CONFIG --class-stats TEMPLATE` (rebm.eval.counterfactuals).
"""

from __future__ import annotations

import logging
from typing import Any, Dict

import numpy as np
import torch

from rebm.config.views import EvaluationSection
from rebm.data.augmentations import build_augmentation
from rebm.data.ood_datasets import FixedImageSet
from rebm.data.pipeline import indist_source
from rebm.distributed import Runtime, setup_logging
from rebm.distributed.collectives import on_main
from rebm.distributed.logs import progress
from rebm.eval.features.fid import (
    FIDError,
    feature_extractor,
    moments_statistics_all_ranks,
    to_8bit,
    write_statistics,
)
from rebm.eval.features.network import feature_network
from rebm.eval.metrics.counterfactuals.attack import COUNTERFACTUAL_PIXELS
from rebm.eval.passes import chunk_loader

LOGGER = logging.getLogger("rebm")


def class_image_set(evaluation: EvaluationSection, label: int, split: str = "train"
                    ) -> FixedImageSet:
    """The in-distribution images of class `label` in `split`, un-augmented, in dataset order."""
    source = indist_source(evaluation.data, split)
    indices = np.flatnonzero(source.labels(np.arange(len(source))).numpy() == label)
    transform = build_augmentation("test", evaluation.data.image_size, source.full_images)
    return FixedImageSet(f"{source.name} class {label}", source, transform, indices,
                         evaluation.data.image_size)


def class_statistics_all_ranks(images: FixedImageSet, runtime: Runtime, features, batch_size: int
                               ) -> tuple:
    """(mu, sigma) of the features of every image of the set (8-bit images read as pytorch-fid
    reads their files, k / 255), from running sums over all ranks. Every rank must call this."""
    loader = chunk_loader(images.images, len(images), batch_size, runtime)
    with torch.no_grad():
        return moments_statistics_all_ranks(
            (features(to_8bit(x.to(runtime.device), COUNTERFACTUAL_PIXELS))
             for x, _ in progress(loader, runtime, images.name, total=len(loader))), runtime)


def run_class_stats_all_ranks(evaluation: EvaluationSection, runtime: Runtime, args
                              ) -> Dict[int, Any]:
    """Writes args.class_stats.format(label=c) for every class c of args.split; {c: (path,
    images)}. Every rank must call this."""
    setup_logging(runtime)
    if "{label}" not in args.class_stats:
        raise FIDError(f"--class-stats '{args.class_stats}' must contain {{label}} (one file "
                       "per class), e.g. data/fid_stats/cifar10_class{label}.npz")
    network = feature_network(evaluation.image_log)
    features = feature_extractor(runtime.device, evaluation.image_log)
    recipe = f"class {{label}} of the {args.split} split, rebm's test transform, 8-bit"
    written = {}
    for label in range(evaluation.data.num_classes):
        images = class_image_set(evaluation, label, args.split)
        if len(images) < 2:
            raise FIDError(f"class {label} has {len(images)} {args.split} images; FID "
                           "statistics need at least 2")
        mu, sigma = class_statistics_all_ranks(images, runtime, features, args.batch_size)
        path, made = args.class_stats.format(label=label), recipe.format(label=label)
        on_main(runtime, lambda p=path, m=mu, s=sigma, r=made:
                write_statistics(p, m, s, network.describe(), r), f"write {path}")
        written[label] = (path, len(images))
        LOGGER.info("class %d: statistics of %d images written to %s", label, len(images), path)
    return written
