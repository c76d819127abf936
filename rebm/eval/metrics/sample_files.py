"""Sample files (registered metrics "sample_grid", "keep_samples" and "samples_npz"): written
from the generation pass without holding every sample.

- sample_grid: the first `eval.grid_num_samples` samples as one PNG, num_classes per row (so
  each class is a column), of the same 8-bit pixels as the other files: each rank keeps only its
  grid samples; they are gathered at the end and rank 0 writes <run_dir>/samples/samples.png
  (samples_step<8-digit step>.png in training).
- keep_samples: sample i as <run_dir>/samples/step_<8-digit step>/<i>.png (samples/eval/ for a
  checkpoint evaluation), the 8-bit pixels FID, IS and precision/recall see
  (`eval.sample_pixels`); every rank writes its own samples as
  they are generated (the run directory must be shared by the ranks, as for checkpoints).
- samples_npz: every sample in one <run_dir>/samples/samples.npz (samples_step<step>.npz), arr_0
  uint8 N x S x S x 3 in index order, for OpenAI's evaluator; ranks write their rows into one
  shared .npy as they go, rank 0 stores it in the npz at the end (needs twice its size on disk
  for a moment).
"""

from __future__ import annotations

import logging
import os
import zipfile
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from rebm.distributed.collectives import (
    all_gather_by_index,
    decide_on_main,
    on_every_rank,
    on_main,
)
from rebm.eval.metric import SAMPLES, EvalContext, Metric, SampleChunk
from rebm.eval.sampling.generation import grid_path, save_grid
from rebm.eval.sampling.samples import sample_files, sample_settings

LOGGER = logging.getLogger("rebm")


def samples_folder(run_dir: str, step: Optional[int]) -> str:
    """<run_dir>/samples/step_<8-digit step>, or samples/eval without a step."""
    name = "eval" if step is None else f"step_{step:08d}"
    return os.path.join(run_dir, "samples", name)


def write_pngs(pixels: Tensor, indices: Tensor, folder: str) -> None:
    """uint8 NCHW images as <folder>/<index>.png."""
    os.makedirs(folder, exist_ok=True)
    for index, image in zip(indices.tolist(), pixels.permute(0, 2, 3, 1).cpu().numpy(),
                            strict=True):
        Image.fromarray(image).save(os.path.join(folder, f"{index}.png"))


class SampleFileMetric(Metric):
    """A sample file: written from the samples, whose files are the seeds'."""

    source = SAMPLES
    protocol = 2  # 2: eval.sample_pixels (floor by default), unblurred seeds, logsumexp_sampling

    @classmethod
    def files(cls, cfg) -> Dict[str, Optional[str]]:
        return sample_files(cfg)


class SampleGrid(SampleFileMetric):
    name = "sample_grid"

    @classmethod
    def settings(cls, cfg) -> Dict[str, Any]:
        return {"grid_num_samples": cfg.eval.grid_num_samples, **sample_settings(cfg)}

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        self.total = min(ctx.cfg.eval.grid_num_samples, ctx.cfg.image_log.num_samples)
        self.images: List[Tensor] = []
        self.indices: List[Tensor] = []

    def update(self, chunk: SampleChunk) -> None:
        keep = chunk.indices < self.total
        if bool(keep.any()):
            pixels = chunk.pixels()
            self.images.append(pixels[keep.to(pixels.device)].cpu())
            self.indices.append(chunk.indices[keep])

    def finish(self) -> Dict[str, Any]:
        ctx = self.ctx
        if ctx.run_dir is None or self.total == 0:
            return {}
        size = ctx.cfg.data.image_size
        # k / 255: save_image writes back exactly the pixels k
        mine = (torch.cat(self.images).float().div(255) if self.images
                else torch.zeros(0, 3, size, size))
        idx = torch.cat(self.indices) if self.indices else torch.zeros(0, dtype=torch.int64)
        device = ctx.runtime.device  # the gather runs on the communication device
        grid = all_gather_by_index(ctx.runtime, mine.to(device), idx.to(device), self.total)

        def write() -> None:
            path = save_grid(grid, ctx.run_dir, ctx.cfg.data.num_classes, ctx.step)
            LOGGER.info("samples saved to %s", path)

        on_main(ctx.runtime, write, f"write the samples into {ctx.run_dir}/samples")
        return {}

    def outputs(self) -> Dict[str, str]:
        if self.ctx.run_dir is None or self.total == 0:
            return {}
        return {"sample_grid": grid_path(self.ctx.run_dir, self.ctx.step)}


class KeepSamples(SampleFileMetric):
    name = "keep_samples"

    @classmethod
    def settings(cls, cfg) -> Dict[str, Any]:
        return {"format": "8-bit PNG", **sample_settings(cfg)}

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        run_dir = ctx.run_dir
        self.folder = None if run_dir is None else samples_folder(run_dir, ctx.step)
        self.error: Optional[OSError] = None

    def update(self, chunk: SampleChunk) -> None:
        if self.folder is None or self.error is not None:
            return
        try:
            write_pngs(chunk.pixels(), chunk.indices, self.folder)
        except OSError as err:  # raised on every rank in finish, not here (no rank left waiting)
            self.error = err

    def finish(self) -> Dict[str, Any]:
        if self.folder is None:
            return {}

        def check() -> None:
            if self.error is not None:
                raise OSError(f"cannot write the samples into {self.folder} "
                              f"({self.error.strerror or self.error})")

        on_every_rank(self.ctx.runtime, check, f"write the samples into {self.folder}")
        if self.ctx.runtime.is_main:
            LOGGER.info("every sample saved to %s", self.folder)
        return {}

    def outputs(self) -> Dict[str, str]:
        return {} if self.folder is None else {"samples": self.folder}


def npz_path(run_dir: str, step: Optional[int]) -> str:
    """<run_dir>/samples/samples.npz, samples_step<8-digit step>.npz in training."""
    name = "samples.npz" if step is None else f"samples_step{step:08d}.npz"
    return os.path.join(run_dir, "samples", name)


def _create_npy(path: str, shape: tuple) -> int:
    """An empty (sparse) uint8 .npy of `shape`; returns the data offset."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    array = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=shape)
    offset = int(array.offset)
    del array
    return offset


def _npy_into_npz(npy: str, path: str) -> None:
    """`npy` as the arr_0 of an uncompressed .npz at `path` (streamed; then removed)."""
    partial = path + ".partial"
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        archive.write(npy, "arr_0.npy")
    os.replace(partial, path)
    os.remove(npy)


class SamplesNpz(SampleFileMetric):
    """Every sample as one .npz (`arr_0`, uint8, N x S x S x 3, index order), the input of
    OpenAI's guided-diffusion evaluator. Every rank writes its chunks straight into one shared
    .npy (plain file writes at the rows' offsets: no rank holds the array); rank 0 then stores
    it as the npz."""

    name = "samples_npz"

    @classmethod
    def settings(cls, cfg) -> Dict[str, Any]:
        return {"format": "npz arr_0 uint8 NHWC", **sample_settings(cfg)}

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        self.error: Optional[OSError] = None
        self.path = None if ctx.run_dir is None else npz_path(ctx.run_dir, ctx.step)
        if self.path is None:
            return
        self.npy = self.path + ".arr_0.npy"
        size = ctx.cfg.data.image_size
        shape = (ctx.cfg.image_log.num_samples, size, size, 3)
        self.row_bytes = size * size * 3
        # rank 0 creates the file before any rank writes (the broadcast orders them)
        self.offset = decide_on_main(ctx.runtime, lambda: _create_npy(self.npy, shape),
                                     f"create {self.npy}")

    def update(self, chunk: SampleChunk) -> None:
        if self.path is None or self.error is not None:
            return
        start = int(chunk.indices[0])  # a chunk is a contiguous index range
        rows = chunk.pixels().permute(0, 2, 3, 1).contiguous().cpu().numpy()
        try:
            with open(self.npy, "r+b") as fh:
                fh.seek(self.offset + start * self.row_bytes)
                fh.write(rows.tobytes())
        except OSError as err:  # raised on every rank in finish
            self.error = err

    def finish(self) -> Dict[str, Any]:
        if self.path is None:
            return {}

        def check() -> None:
            if self.error is not None:
                raise OSError(f"cannot write {self.npy} ({self.error.strerror or self.error})")

        on_every_rank(self.ctx.runtime, check, f"write the samples into {self.npy}")
        on_main(self.ctx.runtime, lambda: _npy_into_npz(self.npy, self.path),
                f"write {self.path}")
        if self.ctx.runtime.is_main:
            LOGGER.info("every sample saved to %s (arr_0, uint8 NHWC)", self.path)
        return {}

    def outputs(self) -> Dict[str, str]:
        return {} if self.path is None else {"samples_npz": self.path}
