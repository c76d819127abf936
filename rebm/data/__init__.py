"""Data: image sources, augmentations, world-size-invariant keyed sampling and the pipelines
that feed training and evaluation (docs/design.md §3)."""

from rebm.data.pipeline import (
    MicroBatch,
    TrainData,
    build_eval_data,
    build_train_data,
    indist_source,
    load_indist,
    load_outdist,
    outdist_source,
)
from rebm.data.sources import DataError

__all__ = ["DataError", "MicroBatch", "TrainData", "build_eval_data", "build_train_data",
           "indist_source", "load_indist", "load_outdist", "outdist_source"]
