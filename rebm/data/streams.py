"""Training input streams and the micro-batches that carry them.

A training method declares the streams its step reads (`Method.streams`); the pipeline loads
those and no others, and each micro-batch maps a stream's name to its images, labels, per-sample
keys and dataset indices. A stream is a dataset ("indist": the in-distribution training split,
"outdist": the out-distribution) seen through one augmentation, with its own shuffle and keys
(seeded from its name), so two streams of the same images draw different samples.

The streams DAT reads (docs/design.md §1) are defined here because any method may reuse them: a
method with other streams declares its own `Stream` in its own package.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterator, Tuple

from torch import Tensor

from rebm.config.views import InputSection

DATASETS = ("indist", "outdist")


@dataclass(frozen=True)
class Stream:
    """One input stream of a training method."""

    name: str  # its key in a MicroBatch; also seeds its shuffle and per-sample keys
    dataset: str  # "indist" (training split) or "outdist"
    augmentation: Callable[[InputSection], str]  # the augmentation's name from the inputs
    description: str = ""

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"stream '{self.name}': dataset must be one of {DATASETS}")


def outdist_augmentation(inputs: InputSection) -> str:
    """The out-distribution stream's augmentation: `augm_type_generation`, except OpenImage-O
    (as the original): `openimages_augm` if set, else generation_od_randomcrop when the
    in-distribution uses generation_id_randomcrop, else generation_od."""
    if inputs.data.outdist_dataset != "OpenImageO":
        return inputs.data.augm_type_generation
    if inputs.data.openimages_augm is not None:
        return inputs.data.openimages_augm
    if inputs.data.augm_type_generation == "generation_id_randomcrop":
        return "generation_od_randomcrop"
    return "generation_od"


def _generation(inputs: InputSection) -> str:
    return inputs.data.augm_type_generation


def _classification(inputs: InputSection) -> str:
    return inputs.data.augm_type_classification


INDIST = Stream("in", "indist", _generation, "in-distribution, generation augmentation")
CLASSIFIER = Stream("clf", "indist", _classification,
                    "in-distribution, classification augmentation, its own shuffle")
OUTDIST = Stream("out", "outdist", outdist_augmentation, "out-distribution")


@dataclass
class StreamBatch:
    """One stream's part of a micro-batch: images float32 [0, 1] NCHW, labels (-1 where the
    dataset has none), int64 per-sample keys from (rand_seed, stream, epoch, index) for
    deterministic attack noise, dataset indices, and the stream's epoch."""

    images: Tensor
    labels: Tensor
    keys: Tensor
    indices: Tensor
    epoch: int = 0

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> "StreamBatch":
        return replace(self, images=fn(self.images), labels=fn(self.labels),
                       keys=fn(self.keys), indices=fn(self.indices))


@dataclass
class MicroBatch:
    """One rank's micro-batch: stream name -> StreamBatch (`batch["in"].images`). Not a
    `collections.abc.Mapping` on purpose: DataLoader would rebuild a mapping from its items and
    drop the other fields.

    replaced: images of this micro-batch whose file was unreadable and replaced (all streams);
    replaced_files: those files."""

    streams: Dict[str, StreamBatch]
    step: int = 0
    micro: int = 0
    replaced: int = 0
    replaced_files: Tuple[str, ...] = field(default=())

    def __getitem__(self, name: str) -> StreamBatch:
        return self.streams[name]

    def __contains__(self, name: str) -> bool:
        return name in self.streams

    def __iter__(self) -> Iterator[str]:
        return iter(self.streams)

    def _map_tensors(self, fn: Callable[[Tensor], Tensor]) -> "MicroBatch":
        return replace(self, streams={k: s.map_tensors(fn) for k, s in self.streams.items()})

    def pin_memory(self) -> "MicroBatch":  # called by DataLoader(pin_memory=True)
        return self._map_tensors(lambda t: t.pin_memory())

    def to(self, device, non_blocking: bool = False) -> "MicroBatch":
        return self._map_tensors(lambda t: t.to(device, non_blocking=non_blocking))
