"""Data entry points of training and evaluation.

Training reads three streams per optimizer step, each of global size `batch_size`
(docs/design.md §1): the EBM in-distribution stream (`augm_type_generation`), the classifier
in-distribution stream (`augm_type_classification`, an independent shuffle of the same images)
and the out-distribution stream. `build_train_data` yields, for every optimizer step from
`start_step` on, this rank's `accumulation_steps` micro-batches.

Guarantees (see sampling.py for the layout):
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

import os
from dataclasses import dataclass, fields
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.transforms.v2 import functional as TF

from rebm.config import BatchPlan, TrainConfig
from rebm.data.augmentations import (
    Transform,
    build_augmentation,
    single_threaded,
)
from rebm.data.files import (
    image_tensor_file,
    load_cifar,
    load_digits,
    load_labelled_folder,
    load_tensor_file,
    load_unlabelled_folder,
)
from rebm.data.imagenet import load_imagenet, load_openimage_o
from rebm.data.sampling import (
    PURPOSE_AUGMENT,
    PURPOSE_SAMPLE,
    StreamSchedule,
    eval_shard,
    sample_keys,
)
from rebm.data.sources import (
    DEFAULT_NOISE_LENGTH,
    DataError,
    ImageDataset,
    ImageSource,
    NoiseSource,
    TinyImagesSource,
    log_replaced_once,
)
from rebm.distributed.runtime import Runtime

__all__ = [
    "DataError",
    "MicroBatch",
    "TrainData",
    "build_eval_data",
    "build_train_data",
    "image_tensor_file",
    "indist_source",
    "load_indist",
    "load_outdist",
    "outdist_source",
]

TINYIMAGES_FILE = "tiny_images.bin"


# --------------------------------------------------------------------------------------------
# Sources from the config
# --------------------------------------------------------------------------------------------
def indist_source(cfg: TrainConfig, split: str) -> ImageSource:
    """The in-distribution images of `split` ("train" or "test") at data.image_size."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    data = cfg.data
    name = data.indist_dataset
    train = split == "train"
    if name in ("cifar10", "cifar10-conditional", "cifar100", "cifar100-conditional"):
        source = load_cifar(data.indist_ds_dir, 100 if "100" in name else 10, train,
                            data.download)
        if data.image_size != 32:  # resized once here, not per sample
            source.data = TF.resize(source.data, [data.image_size] * 2, antialias=True)
    elif name == "digits":
        source = load_digits(data.image_size, train)
    elif name == "imagefolder":
        source = load_labelled_folder(os.path.join(data.indist_ds_dir, split), data.image_size)
    elif name == "ImageNet":
        source = load_imagenet(data.indist_ds_dir, split, data.image_size, data.num_classes)
    else:
        raise DataError(f"unknown data.indist_dataset '{name}'")
    _check_labels(source, cfg)
    return source


def _check_labels(source: ImageSource, cfg: TrainConfig) -> None:
    labels = source.labels(np.arange(len(source)))
    if len(labels) and int(labels.max()) >= cfg.data.num_classes:
        raise DataError(
            f"{source.name}: labels go up to {int(labels.max())} but data.num_classes is "
            f"{cfg.data.num_classes}; set data.num_classes={int(labels.max()) + 1}"
        )


def outdist_source(cfg: TrainConfig, length: Optional[int] = None) -> ImageSource:
    """The out-distribution images; `length` is the virtual size of procedural noise
    (default 50,000; training passes the in-distribution train size)."""
    data = cfg.data
    name = data.outdist_dataset
    size = data.image_size
    if name in ("tinyimages", "80m-tinyimages"):
        path = data.outdist_std_dir
        if os.path.isdir(path):
            path = os.path.join(path, TINYIMAGES_FILE)
        return TinyImagesSource(path, size, data.outdist_exclude_index)
    if name == "imagefolder":
        return load_unlabelled_folder(data.outdist_std_dir, size)
    if name == "OpenImageO":
        return load_openimage_o(data.outdist_std_dir, size, cfg.openimages_max_samples)
    if name == "tensorfile":
        return load_tensor_file(data.outdist_std_dir, size)
    if name in ("noise", "uniform-noise", "lowfreq-noise"):
        low_res = max(1, size // 4) if name == "lowfreq-noise" else None  # 8x8 at 32 px
        return NoiseSource(length or DEFAULT_NOISE_LENGTH, size, cfg.rand_seed, low_res)
    raise DataError(f"unknown data.outdist_dataset '{name}'")


def load_indist(cfg: TrainConfig, split: str, augm: str = "test",
                seed: Optional[int] = None) -> ImageDataset:
    """Dataset of (float [0, 1] CHW image, label) with augmentation `augm` (a name of
    augmentations.py). seed=None: augmentation from the ambient RNG; else seeded per sample
    (call `.set_epoch`)."""
    source = indist_source(cfg, split)
    transform = build_augmentation(augm, cfg.data.image_size, source.full_images)
    return ImageDataset(source, transform, seed, stream="eval")


def load_outdist(cfg: TrainConfig, augm: str = "none", length: Optional[int] = None
                 ) -> ImageDataset:
    """Dataset of (float [0, 1] CHW image, -1) of the configured out-distribution."""
    source = outdist_source(cfg, length)
    transform = None if source.is_procedural else build_augmentation(
        augm, cfg.data.image_size, source.full_images)
    return ImageDataset(source, transform, None, stream="out")


def outdist_augmentation(cfg: TrainConfig) -> str:
    """The out-distribution stream's augmentation: `augm_type_generation`, except OpenImage-O
    (as the original): `openimages_augm` if set, else generation_od_randomcrop when the
    in-distribution uses generation_id_randomcrop, else generation_od."""
    if cfg.data.outdist_dataset != "OpenImageO":
        return cfg.augm_type_generation
    if cfg.openimages_augm is not None:
        return cfg.openimages_augm
    if cfg.augm_type_generation == "generation_id_randomcrop":
        return "generation_od_randomcrop"
    return "generation_od"


# --------------------------------------------------------------------------------------------
# DataLoader settings
# --------------------------------------------------------------------------------------------
def _worker_init(worker_id: int) -> None:
    # One thread per worker: the workers are the parallelism; more threads oversubscribe cores.
    torch.set_num_threads(1)


def loader_workers(cfg: TrainConfig, runtime: Runtime) -> int:
    """data.num_workers capped to this process's share of the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    per_process = (cores or 1) // max(1, runtime.local_world_size)
    return max(0, min(cfg.data.num_workers, per_process))


def _loader_generator() -> torch.Generator:
    """DataLoader draws its workers' base seed from `generator` (default: torch's global RNG) on
    every iter(). A private generator keeps the training process's RNG stream independent of
    when loaders are created (exact resume); the base seed is unused, samples are seeded."""
    return torch.Generator().manual_seed(0)


def _loader_kwargs(cfg: TrainConfig, runtime: Runtime, persistent: bool) -> dict:
    workers = loader_workers(cfg, runtime)
    kwargs = dict(num_workers=workers, pin_memory=runtime.device.type == "cuda",
                  worker_init_fn=_worker_init)
    if workers > 0:
        kwargs.update(persistent_workers=persistent, prefetch_factor=2)
    return kwargs


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------
@dataclass
class MicroBatch:
    """One rank's micro-batch of the three streams; images float32 [0, 1] NCHW.

    key_*: int64 per-sample keys from (rand_seed, stream, epoch, dataset index), for per-sample
    deterministic attack noise. index_*: dataset indices. epoch_*: the epoch of each stream.
    replaced: images of this micro-batch whose file was unreadable and replaced (all streams);
    replaced_files: those files."""

    x_in: Tensor
    y_in: Tensor
    x_c: Tensor
    y_c: Tensor
    x_out: Tensor
    key_in: Tensor
    key_c: Tensor
    key_out: Tensor
    index_in: Optional[Tensor] = None
    index_c: Optional[Tensor] = None
    index_out: Optional[Tensor] = None
    step: int = 0
    micro: int = 0
    epoch_in: int = 0
    epoch_c: int = 0
    epoch_out: int = 0
    replaced: int = 0
    replaced_files: Tuple[str, ...] = ()

    def _map_tensors(self, fn) -> "MicroBatch":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return MicroBatch(**{k: fn(v) if isinstance(v, Tensor) else v for k, v in values.items()})

    def pin_memory(self) -> "MicroBatch":  # called by DataLoader(pin_memory=True)
        return self._map_tensors(lambda t: t.pin_memory())

    def to(self, device, non_blocking: bool = False) -> "MicroBatch":
        return self._map_tensors(lambda t: t.to(device, non_blocking=non_blocking))


@dataclass
class _Stream:
    """One training stream: where it reads (schedule) and how it augments."""

    name: str  # "in", "clf" or "out" (see sampling.STREAM_CODES)
    source: ImageSource
    transform: Optional[Transform]
    schedule: StreamSchedule

    def read(self, step: int, micro: int, rank: int, plan: BatchPlan):
        indices, epoch = self.schedule.rank_indices(
            step, rank, plan.world_size, micro, plan.per_device_batch_size
        )
        seed = self.schedule.seed
        augment_seeds = sample_keys(seed, self.name, epoch, indices, PURPOSE_AUGMENT)
        batch = self.source.read(indices, self.transform, augment_seeds)
        keys = torch.from_numpy(sample_keys(seed, self.name, epoch, indices, PURPOSE_SAMPLE))
        return batch, keys, torch.from_numpy(indices), epoch


class _MicroBatchDataset(Dataset):
    """Map-style dataset keyed by (step, micro): item = this rank's MicroBatch. A DataLoader
    worker builds whole micro-batches, so the result cannot depend on the worker count."""

    def __init__(self, streams: List[_Stream], rank: int, plan: BatchPlan):
        self.ebm, self.clf, self.out = streams
        self.rank = rank
        self.plan = plan

    def __getitem__(self, key) -> MicroBatch:
        with single_threaded():  # tiny per-image ops: threads only add overhead
            return self._build(*key)

    def _build(self, step: int, micro: int) -> MicroBatch:
        b_in, key_in, idx_in, ep_in = self.ebm.read(step, micro, self.rank, self.plan)
        b_c, key_c, idx_c, ep_c = self.clf.read(step, micro, self.rank, self.plan)
        b_out, key_out, idx_out, ep_out = self.out.read(step, micro, self.rank, self.plan)
        replaced = b_in.replaced + b_c.replaced + b_out.replaced
        return MicroBatch(
            x_in=b_in.images, y_in=b_in.labels, x_c=b_c.images, y_c=b_c.labels,
            x_out=b_out.images, key_in=key_in, key_c=key_c, key_out=key_out,
            index_in=idx_in, index_c=idx_c, index_out=idx_out,
            step=step, micro=micro, epoch_in=ep_in, epoch_c=ep_c, epoch_out=ep_out,
            replaced=len(replaced), replaced_files=replaced,
        )


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
        self.schedules = {s.name: s.schedule for s in (dataset.ebm, dataset.clf, dataset.out)}
        self.replaced_images = 0
        self._rank = dataset.rank

    def _note(self, micro_batch: MicroBatch) -> MicroBatch:
        if micro_batch.replaced:
            self.replaced_images += micro_batch.replaced
            log_replaced_once(micro_batch.replaced_files, f" (rank {self._rank})")
        return micro_batch

    @property
    def steps_per_epoch(self) -> int:
        """Steps per epoch of the EBM in-distribution stream."""
        return self.schedules["in"].steps_per_epoch

    def epoch_of(self, step: int) -> int:
        return self.schedules["in"].epoch_of(step)

    def step_batch(self, step: int) -> List[MicroBatch]:
        """This rank's micro-batches of one step, computed directly (no loader, no workers)."""
        return [self._note(self._dataset[(step, m)])
                for m in range(self.plan.accumulation_steps)]

    def __iter__(self) -> Iterator[List[MicroBatch]]:
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
        parts = [
            f"{name}: {len(s_.source)} images ({s_.source.name}), "
            f"{s_.schedule.steps_per_epoch} steps/epoch"
            for name, s_ in (("in", self._dataset.ebm), ("clf", self._dataset.clf),
                             ("out", self._dataset.out))
        ]
        return "; ".join(parts)


def _schedule(n: int, cfg: TrainConfig, stream: str, source: ImageSource) -> StreamSchedule:
    if n < cfg.batch_size:
        raise DataError(f"{source.name}: {n} images, fewer than one global batch "
                        f"(batch_size={cfg.batch_size}); lower batch_size or add data")
    return StreamSchedule(n=n, global_batch=cfg.batch_size, seed=cfg.rand_seed, stream=stream)


def build_train_data(cfg: TrainConfig, runtime: Runtime, plan: BatchPlan,
                     start_step: int = 0) -> TrainData:
    """The three training streams of this rank, starting at optimizer step `start_step`."""
    size = cfg.data.image_size
    train = indist_source(cfg, "train")
    out = outdist_source(cfg, length=len(train))
    out_transform = None if out.is_procedural else build_augmentation(
        outdist_augmentation(cfg), size, out.full_images)
    full = train.full_images
    streams = [
        _Stream("in", train, build_augmentation(cfg.augm_type_generation, size, full),
                _schedule(len(train), cfg, "in", train)),
        _Stream("clf", train, build_augmentation(cfg.augm_type_classification, size, full),
                _schedule(len(train), cfg, "clf", train)),
        _Stream("out", out, out_transform, _schedule(len(out), cfg, "out", out)),
    ]
    dataset = _MicroBatchDataset(streams, runtime.rank, plan)
    return TrainData(dataset, plan, start_step, _loader_kwargs(cfg, runtime, persistent=False))


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


def build_eval_data(cfg: TrainConfig, runtime: Runtime, batch_size: int,
                    split: str = "test", indices: Optional[Sequence[int]] = None) -> DataLoader:
    """This rank's shard of the in-distribution `split`, un-augmented, as (x, y, index) batches
    of up to `batch_size` (per rank). `indices`: this rank's dataset indices, in order (the
    evaluation chooses them); default rank, rank+W, ..."""
    dataset = _IndexedDataset(load_indist(cfg, split, "test"))
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=(ShardSampler(len(dataset), runtime.rank, runtime.world_size) if indices is None
                 else list(indices)),
        drop_last=False,
        generator=_loader_generator(),
        **_loader_kwargs(cfg, runtime, persistent=True),
    )
