"""Data entry points of training and evaluation.

Training reads the streams a method declares (rebm/data/streams.py), each of global size
`batch_size` per optimizer step; DAT's are the EBM in-distribution stream
(`augm_type_generation`), the classifier in-distribution stream (`augm_type_classification`, an
independent shuffle of the same images) and the out-distribution stream (docs/design.md §1).
`build_train_data` yields, for every optimizer step from `start_step` on, this rank's
`accumulation_steps` micro-batches.

Guarantees (see indexing.py for the layout):
- the union over ranks and micro-steps of step s is exactly the single-process global batch of
  step s, with the same augmentations — a sample's augmentation is seeded from
  (rand_seed, stream, epoch, index), not from a worker or process RNG;
- each stream has its own epochs (steps_per_epoch = its length // batch_size, drop_last) and its
  own shuffle per (rand_seed, stream, epoch);
- resume is O(1): step s is computed directly, nothing before it is loaded;
- results do not depend on num_workers;
- an unreadable image file is replaced by a function of its index alone (imagenet.py), so the
  replacement is the same on any world size; each micro-batch counts its replacements
  (`MicroBatch.replaced`) and each rank logs every bad file once.

Evaluation (`build_eval_data`) gives rank r the indices r, r+W, ... — each test image exactly once
over all ranks, no padding duplicates — as (x, y, index) batches.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from rebm.config import BatchPlan, DataConfig
from rebm.config.datasets import INDIST_DATASETS, OUTDIST_DATASETS
from rebm.config.views import InputSection
from rebm.data.augmentations import (
    Transform,
    build_augmentation,
    single_threaded,
)
from rebm.data.files import (
    image_tensor_file,
)
from rebm.data.indexing import (
    PURPOSE_AUGMENT,
    PURPOSE_SAMPLE,
    StreamSchedule,
    eval_shard,
    sample_keys,
)
from rebm.data.sources import (
    DataError,
    ImageDataset,
    ImageSource,
    log_replaced_once,
)
from rebm.data.streams import (
    CLASSIFIER,
    INDIST,
    OUTDIST,
    MicroBatch,
    Stream,
    StreamBatch,
    outdist_augmentation,
)
from rebm.distributed.runtime import Runtime

__all__ = [
    "CLASSIFIER",
    "DataError",
    "INDIST",
    "MicroBatch",
    "OUTDIST",
    "Stream",
    "StreamBatch",
    "TrainData",
    "build_eval_data",
    "build_train_data",
    "image_tensor_file",
    "indist_source",
    "load_indist",
    "load_outdist",
    "outdist_augmentation",
    "outdist_source",
]

# --------------------------------------------------------------------------------------------
# Sources from the config
# --------------------------------------------------------------------------------------------
def indist_source(data: DataConfig, split: str) -> ImageSource:
    """The in-distribution images of `split` ("train" or "test") at data.image_size, from the
    dataset `data.indist_dataset` registered in rebm/data/sets."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    source = INDIST_DATASETS.get(data.indist_dataset).loader(data, split)
    _check_labels(source, data)
    return source


def _check_labels(source: ImageSource, data: DataConfig) -> None:
    labels = source.labels(np.arange(len(source)))
    if len(labels) and int(labels.max()) >= data.num_classes:
        raise DataError(
            f"{source.name}: labels go up to {int(labels.max())} but data.num_classes is "
            f"{data.num_classes}; set data.num_classes={int(labels.max()) + 1}"
        )


def outdist_source(inputs: InputSection, length: Optional[int] = None) -> ImageSource:
    """The out-distribution images of `data.outdist_dataset` (rebm/data/sets); `length` is the
    virtual size of procedural noise (default 50,000; training passes the in-distribution train
    size)."""
    return OUTDIST_DATASETS.get(inputs.data.outdist_dataset).loader(inputs, length)


def load_indist(data: DataConfig, split: str, augm: str = "test",
                source: Optional[ImageSource] = None) -> ImageDataset:
    """Dataset of (float [0, 1] CHW image, label) with augmentation `augm` (a name of
    augmentations.py), drawn from the ambient RNG; `source`: the split's images if the caller
    has them already (indist_source)."""
    source = source if source is not None else indist_source(data, split)
    transform = build_augmentation(augm, data.image_size, source.full_images, data.cutout_size)
    return ImageDataset(source, transform)


def load_outdist(inputs: InputSection, augm: str = "none", length: Optional[int] = None
                 ) -> ImageDataset:
    """Dataset of (float [0, 1] CHW image, -1) of the configured out-distribution."""
    source = outdist_source(inputs, length)
    transform = None if source.is_procedural else build_augmentation(
        augm, inputs.data.image_size, source.full_images, inputs.data.cutout_size)
    return ImageDataset(source, transform)


# --------------------------------------------------------------------------------------------
# DataLoader settings
# --------------------------------------------------------------------------------------------
def _worker_init(worker_id: int) -> None:
    # One thread per worker: the workers are the parallelism; more threads oversubscribe cores.
    torch.set_num_threads(1)


def loader_workers(data: DataConfig, runtime: Runtime) -> int:
    """data.num_workers capped to this process's share of the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    per_process = (cores or 1) // max(1, runtime.local_world_size)
    return max(0, min(data.num_workers, per_process))


def _loader_generator() -> torch.Generator:
    """DataLoader draws its workers' base seed from `generator` (default: torch's global RNG) on
    every iter(). A private generator keeps the training process's RNG stream independent of
    when loaders are created (exact resume); the base seed is unused, samples are seeded."""
    return torch.Generator().manual_seed(0)


def _loader_kwargs(data: DataConfig, runtime: Runtime, persistent: bool) -> dict:
    workers = loader_workers(data, runtime)
    kwargs = dict(num_workers=workers, pin_memory=runtime.device.type == "cuda",
                  worker_init_fn=_worker_init)
    if workers > 0:
        kwargs.update(persistent_workers=persistent, prefetch_factor=2)
    return kwargs


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------
@dataclass
class _LoadedStream:
    """One training stream as loaded: where it reads (schedule) and how it augments."""

    name: str
    source: ImageSource
    transform: Optional[Transform]
    schedule: StreamSchedule

    def read(self, step: int, micro: int, rank: int, plan: BatchPlan
             ) -> Tuple[StreamBatch, Tuple[str, ...]]:
        """This rank's part of the stream at (step, micro), and the files it replaced."""
        indices, epoch = self.schedule.rank_indices(
            step, rank, plan.world_size, micro, plan.per_device_batch_size
        )
        seed = self.schedule.seed
        augment_seeds = sample_keys(seed, self.name, epoch, indices, PURPOSE_AUGMENT)
        batch = self.source.read(indices, self.transform, augment_seeds)
        keys = torch.from_numpy(sample_keys(seed, self.name, epoch, indices, PURPOSE_SAMPLE))
        return StreamBatch(images=batch.images, labels=batch.labels, keys=keys,
                           indices=torch.from_numpy(indices), epoch=epoch), batch.replaced


class _MicroBatchDataset(Dataset):
    """Map-style dataset keyed by (step, micro): item = this rank's MicroBatch. A DataLoader
    worker builds whole micro-batches, so the result cannot depend on the worker count."""

    def __init__(self, streams: List[_LoadedStream], rank: int, plan: BatchPlan):
        self.streams = streams
        self.rank = rank
        self.plan = plan

    def __getitem__(self, key) -> MicroBatch:
        with single_threaded():  # tiny per-image ops: threads only add overhead
            return self._build(*key)

    def _build(self, step: int, micro: int) -> MicroBatch:
        batches, replaced = {}, ()
        for stream in self.streams:
            batches[stream.name], stream_replaced = stream.read(step, micro, self.rank, self.plan)
            replaced += tuple(stream_replaced)
        return MicroBatch(batches, step=step, micro=micro, replaced=len(replaced),
                          replaced_files=replaced)


class _StepSampler(Sampler):
    """(step, micro) for step = start, start+1, ... forever."""

    def __init__(self, start_step: int, accumulation_steps: int):
        self.start_step = start_step
        self.accumulation_steps = accumulation_steps

    def __iter__(self):
        step = self.start_step
        while True:
            for micro in range(self.accumulation_steps):
                yield step, micro
            step += 1


class TrainData:
    """Iterating yields, for optimizer step start_step, start_step+1, ..., the list of this
    rank's `plan.accumulation_steps` MicroBatches (each of plan.per_device_batch_size), forever.
    Every `iter()` starts again at `start_step`.

    `replaced_images`: images this rank's batches replaced so far (unreadable files, counted
    every time they are met); the engine sums `MicroBatch.replaced` into its metrics window.
    Each unreadable file is logged once by this rank's main process (workers only report)."""

    def __init__(self, dataset: _MicroBatchDataset, plan: BatchPlan, start_step: int,
                 loader_kwargs: dict):
        self._dataset = dataset
        self.plan = plan
        self.start_step = start_step
        self._loader_kwargs = loader_kwargs
        # epochs are counted on the first declared stream (DAT: "in"; stage 1: "clf")
        self._epoch_schedule = dataset.streams[0].schedule
        self.replaced_images = 0
        self._rank = dataset.rank

    def _note(self, micro_batch: MicroBatch) -> MicroBatch:
        if micro_batch.replaced:
            self.replaced_images += micro_batch.replaced
            log_replaced_once(micro_batch.replaced_files, f" (rank {self._rank})")
        return micro_batch

    @property
    def steps_per_epoch(self) -> int:
        """Steps per epoch of the first stream the method declared."""
        return self._epoch_schedule.steps_per_epoch

    def epoch_of(self, step: int) -> int:
        return self._epoch_schedule.epoch_of(step)

    def step_batch(self, step: int) -> List[MicroBatch]:
        """This rank's micro-batches of one step, computed directly (no loader, no workers)."""
        return [self._note(self._dataset[(step, m)])
                for m in range(self.plan.accumulation_steps)]

    def __iter__(self) -> Iterator[List[MicroBatch]]:
        if not self._loader_kwargs["num_workers"] and not self._loader_kwargs["pin_memory"]:
            # in this process: a DataLoader would only call step_batch's items one by one
            yield from (self.step_batch(step) for step in itertools.count(self.start_step))
            return
        loader = DataLoader(
            self._dataset,
            batch_size=None,  # items are already micro-batches
            sampler=_StepSampler(self.start_step, self.plan.accumulation_steps),
            generator=_loader_generator(),
            **self._loader_kwargs,
        )
        group: List[MicroBatch] = []
        for micro_batch in loader:
            group.append(self._note(micro_batch))
            if len(group) == self.plan.accumulation_steps:
                yield group
                group = []

    def describe(self) -> str:
        return "; ".join(f"{s_.name}: {len(s_.source)} images ({s_.source.name}), "
                         f"{s_.schedule.steps_per_epoch} steps/epoch"
                         for s_ in self._dataset.streams)


def _schedule(n: int, inputs: InputSection, stream: str, source: ImageSource) -> StreamSchedule:
    if n < inputs.schedule.batch_size:
        raise DataError(f"{source.name}: {n} images, fewer than one global batch "
                        f"(batch_size={inputs.schedule.batch_size}); lower batch_size or add data")
    return StreamSchedule(n=n, global_batch=inputs.schedule.batch_size, seed=inputs.schedule.rand_seed,
                          stream=stream)


def build_train_data(inputs: InputSection, runtime: Runtime, plan: BatchPlan,
                     streams: Sequence[Stream], start_step: int = 0) -> TrainData:
    """This rank's training `streams` (those a method declares, in its order; the others are
    not loaded), starting at optimizer step `start_step`."""
    if not streams:
        raise ValueError("a training method must declare at least one input stream")
    size = inputs.data.image_size
    train = indist_source(inputs.data, "train")  # its length also sizes procedural noise
    sources: Dict[str, ImageSource] = {"indist": train}
    if any(stream.dataset == "outdist" for stream in streams):
        sources["outdist"] = outdist_source(inputs, length=len(train))
    loaded = []
    for stream in streams:
        source = sources[stream.dataset]
        transform = None if source.is_procedural else build_augmentation(
            stream.augmentation(inputs), size, source.full_images, inputs.data.cutout_size)
        loaded.append(_LoadedStream(stream.name, source, transform,
                                    _schedule(len(source), inputs, stream.name, source)))
    dataset = _MicroBatchDataset(loaded, runtime.rank, plan)
    return TrainData(dataset, plan, start_step,
                     _loader_kwargs(inputs.data, runtime, persistent=False))


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------
class _IndexedDataset(Dataset):
    """(x, y, index) so evaluation can match per-sample results across ranks."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        x, y = self.dataset[index]
        return x, y, index


class ShardSampler(Sampler):
    """Indices rank, rank+W, ... of [0, n): each index on exactly one rank, no padding."""

    def __init__(self, n: int, rank: int, world_size: int):
        self.indices = eval_shard(n, rank, world_size)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def build_eval_data(data: DataConfig, runtime: Runtime, batch_size: int,
                    split: str = "test", indices: Optional[Sequence[int]] = None,
                    source: Optional[ImageSource] = None) -> DataLoader:
    """This rank's shard of the in-distribution `split`, un-augmented, as (x, y, index) batches
    of up to `batch_size` (per rank). `indices`: this rank's dataset indices, in order (the
    evaluation chooses them); default rank, rank+W, ... `source`: the split's images, if the
    caller loaded them already."""
    dataset = _IndexedDataset(load_indist(data, split, "test", source))
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=(ShardSampler(len(dataset), runtime.rank, runtime.world_size) if indices is None
                 else list(indices)),
        drop_last=False,
        generator=_loader_generator(),
        **_loader_kwargs(data, runtime, persistent=True),
    )
