"""Data: image sources, augmentations, world-size-invariant keyed sampling, the training streams
a method declares and the pipelines that feed training and evaluation (docs/design.md §3)."""

from rebm.data.pipeline import (
    TrainData,
    build_eval_data,
    build_train_data,
    indist_source,
    load_indist,
    load_outdist,
    outdist_source,
)
from rebm.data.sources import DataError
from rebm.data.streams import CLASSIFIER, INDIST, OUTDIST, MicroBatch, Stream, StreamBatch

__all__ = ["CLASSIFIER", "DataError", "INDIST", "MicroBatch", "OUTDIST", "Stream", "StreamBatch",
           "TrainData", "build_eval_data", "build_train_data", "indist_source", "load_indist",
           "load_outdist", "outdist_source"]
