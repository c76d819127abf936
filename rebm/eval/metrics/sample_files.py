"""Sample files (registered metrics "sample_grid", "keep_samples" and "samples_npz"): written
from the generation pass without holding every sample.

- sample_grid: the two grids of the original's compute_fid (rebm/eval/eval_utils.py:434-551 at
  fb2ffc7), <run_dir>/samples/gen_samples.png of the samples and seed_samples.png of the seeds
  they started from (gen_samples_step<8-digit step>.png and seed_samples_step<...>.png in
  training): a row per class of its first 10 samples (`grid_indices`), padding 1, each grid
  min-max normalised over its own images and quantised by floor(255 x) (`grid_pixels`). Each
  rank keeps only its grid images (float); the ranks agree on each grid's minimum and maximum,
  quantise their own rows, and rank 0 writes the gathered rows.
- keep_samples: sample i as <run_dir>/samples/step_<8-digit step>/<i>.png (samples/eval/ for a
  checkpoint evaluation), the 8-bit pixels FID, IS and precision/recall see
  (`eval.sample_pixels`); every rank writes its own samples as
  they are generated (the run directory must be shared by the ranks, as for checkpoints).
- samples_npz: every sample in one <run_dir>/samples/samples.npz (samples_step<step>.npz), arr_0
  uint8 N x S x S x 3 in index order, for OpenAI's evaluator; ranks write their rows into one
  shared .npy as they go, rank 0 stores it in the npz at the end (needs twice its size on disk
  for a moment) through `samples.npz.partial` and a rename. A failed write removes the .npy and
  the .partial and leaves an earlier samples.npz as it was; the next run reuses both names.
"""

from __future__ import annotations

import logging
import math
import os
import zipfile
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from rebm.config.views import EvaluationSection
from rebm.distributed.collectives import (
    WriteFailed,
    all_gather_by_index,
    all_reduce_max,
    all_reduce_min,
    decide_on_main,
    on_every_rank,
    on_main,
)
from rebm.eval.files import remove_quietly, write_replacing
from rebm.eval.metric import SAMPLES, EvalContext, Metric, SampleChunk
from rebm.eval.sampling.generation import (
    GRID_KINDS,
    grid_indices,
    grid_pixels,
    save_grid,
)
from rebm.eval.sampling.samples import sample_files, sample_settings

LOGGER = logging.getLogger("rebm")





def write_pngs(pixels: Tensor, indices: Tensor, folder: str) -> None:
    """uint8 NCHW images as <folder>/<index>.png."""
    for index, image in zip(indices.tolist(), pixels.permute(0, 2, 3, 1).cpu().numpy(),
                            strict=True):
        png = Image.fromarray(image)
        write_replacing(os.path.join(folder, f"{index}.png"),
                        lambda tmp, png=png: png.save(tmp, format="PNG"))


class SampleFileMetric(Metric):
    """A sample file: written from the samples, whose files are the seeds'."""

    source = SAMPLES
    protocol = 2  # 2: eval.sample_pixels (floor by default), unblurred seeds, logsumexp_sampling
    summary = ()  # files, no value for the one-line summary

    @classmethod
    def files(cls, evaluation: EvaluationSection) -> Dict[str, Optional[str]]:
        return sample_files(evaluation)


class SampleGrid(SampleFileMetric):
    name = "sample_grid"
    protocol = 3  # 3: the original's rows per class, normalisation and names; the seed grid

    @classmethod
    def settings(cls, evaluation: EvaluationSection) -> Dict[str, Any]:
        return {"grid_num_samples": evaluation.eval.grid_num_samples, **sample_settings(evaluation)}

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        evaluation = ctx.evaluation
        order = grid_indices(evaluation.image_log.num_samples, evaluation.data.num_classes,
                             evaluation.eval.grid_num_samples)
        self.position = {index: place for place, index in enumerate(order)}
        self.kept: Dict[str, List[Tensor]] = {kind: [] for kind in GRID_KINDS}
        self.places: List[int] = []

    def update(self, chunk: SampleChunk) -> None:
        rows = [j for j, index in enumerate(chunk.indices.tolist()) if index in self.position]
        if not rows:
            return
        for kind, images in zip(GRID_KINDS, (chunk.images, chunk.seeds), strict=True):
            take = torch.tensor(rows, device=images.device)
            self.kept[kind].append(images[take].detach().float().cpu())
        self.places.extend(self.position[int(chunk.indices[j])] for j in rows)

    def finish_all_ranks(self) -> Dict[str, Any]:
        ctx = self.ctx
        if ctx.run_dir is None or not self.position:
            return {}
        grids = {kind: self._grid_all_ranks(kind) for kind in GRID_KINDS}

        def write() -> None:
            for kind, pixels in grids.items():
                save_grid(pixels, ctx.run_dir.sample_grid(ctx.step, kind))
            LOGGER.info("sample and seed grids saved to %s",
                        os.path.dirname(ctx.run_dir.sample_grid(ctx.step)))

        on_main(ctx.runtime, write, f"write the sample grids into {ctx.run_dir.path}/samples")
        return {}

    def _grid_all_ranks(self, kind: str) -> Tensor:
        """The `kind` grid's uint8 images in grid order, on every rank: normalised over every
        rank's images (the original normalises the whole grid), each rank quantising its own."""
        runtime, size = self.ctx.runtime, self.ctx.evaluation.data.image_size
        kept = self.kept[kind]
        mine = torch.cat(kept) if kept else torch.zeros(0, 3, size, size)
        # a rank without grid images takes no part in the minimum and maximum
        low = all_reduce_min(runtime, mine.min() if kept else torch.tensor(math.inf))
        high = all_reduce_max(runtime, mine.max() if kept else torch.tensor(-math.inf))
        pixels = grid_pixels(mine, float(low), float(high))
        device = runtime.device  # the gather runs on the communication device
        places = torch.tensor(self.places, dtype=torch.int64)
        return all_gather_by_index(runtime, pixels.to(device), places.to(device),
                                   len(self.position)).cpu()

    def outputs(self) -> Dict[str, str]:
        if self.ctx.run_dir is None or not self.position:
            return {}
        run_dir, step = self.ctx.run_dir, self.ctx.step
        return {"sample_grid": run_dir.sample_grid(step, "gen"),
                "seed_grid": run_dir.sample_grid(step, "seed")}


class KeepSamples(SampleFileMetric):
    name = "keep_samples"

    @classmethod
    def settings(cls, evaluation: EvaluationSection) -> Dict[str, Any]:
        return {"format": "8-bit PNG", **sample_settings(evaluation)}

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        run_dir = ctx.run_dir
        self.folder = None if run_dir is None else run_dir.samples_folder(ctx.step)
        self.error: Optional[OSError] = None

    def update(self, chunk: SampleChunk) -> None:
        if self.folder is None or self.error is not None:
            return
        try:
            write_pngs(chunk.pixels(), chunk.indices, self.folder)
        except OSError as err:  # raised on every rank in finish_all_ranks (no rank left waiting)
            self.error = err

    def finish_all_ranks(self) -> Dict[str, Any]:
        if self.folder is None:
            return {}

        def check() -> None:
            if self.error is not None:
                raise WriteFailed(f"cannot write the samples into {self.folder} "
                                  f"({self.error.strerror or self.error}); free disk space or "
                                  "write elsewhere with run_dir=PATH")

        on_every_rank(self.ctx.runtime, check, f"write the samples into {self.folder}")
        if self.ctx.runtime.is_main:
            LOGGER.info("every sample saved to %s", self.folder)
        return {}

    def outputs(self) -> Dict[str, str]:
        return {} if self.folder is None else {"samples": self.folder}





def _create_npy(path: str, shape: tuple) -> int:
    """An empty (sparse) uint8 .npy of `shape` (replacing one an earlier run left); returns
    the data offset. Removed again when it cannot be made (a file-size limit, a full disk)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        array = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=shape)
    except OSError as err:
        remove_quietly(path)
        raise WriteFailed(f"cannot create {path} ({err.strerror or err}); free disk space or "
                          "write elsewhere with run_dir=PATH") from None
    offset = int(array.offset)
    del array
    return offset


def _npy_into_npz(npy: str, path: str) -> None:
    """`npy` as the arr_0 of an uncompressed .npz at `path` (streamed through `path`.partial,
    then renamed: a samples.npz is always a finished one); the .npy is removed either way."""
    partial = path + ".partial"
    try:
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            archive.write(npy, "arr_0.npy")
        os.replace(partial, path)
    except OSError as err:
        raise OSError(err.errno, f"{err.strerror or err}, writing {os.path.basename(path)}",
                      path) from None
    finally:
        remove_quietly(partial)
        remove_quietly(npy)


class SamplesNpz(SampleFileMetric):
    """Every sample as one .npz (`arr_0`, uint8, N x S x S x 3, index order), the input of
    OpenAI's guided-diffusion evaluator. Every rank writes its chunks straight into one shared
    .npy (plain file writes at the rows' offsets: no rank holds the array); rank 0 then stores
    it as the npz."""

    name = "samples_npz"

    @classmethod
    def settings(cls, evaluation: EvaluationSection) -> Dict[str, Any]:
        return {"format": "npz arr_0 uint8 NHWC", **sample_settings(evaluation)}

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        self.error: Optional[OSError] = None
        self.path = None if ctx.run_dir is None else ctx.run_dir.samples_npz(ctx.step)
        if self.path is None:
            return
        self.npy = self.path + ".arr_0.npy"
        size = ctx.evaluation.data.image_size
        self.shape = (ctx.evaluation.image_log.num_samples, size, size, 3)
        self.row_bytes = size * size * 3
        self.offset = 0

    def start_all_ranks(self) -> None:
        """Rank 0 creates the file before any rank writes (the broadcast orders them)."""
        if self.path is not None:
            self.offset = decide_on_main(self.ctx.runtime,
                                         lambda: _create_npy(self.npy, self.shape),
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
        except OSError as err:  # raised on every rank in finish_all_ranks
            self.error = err

    def finish_all_ranks(self) -> Dict[str, Any]:
        if self.path is None:
            return {}

        def check() -> None:
            if self.error is not None:
                raise WriteFailed(f"cannot write {self.npy} ({self.error.strerror or self.error})"
                                  "; free disk space or write elsewhere with run_dir=PATH")

        try:
            on_every_rank(self.ctx.runtime, check, f"write the samples into {self.npy}")
        except Exception:  # nothing half-written stays behind (rank 0's files)
            if self.ctx.runtime.is_main:
                remove_quietly(self.npy)
            raise
        on_main(self.ctx.runtime, lambda: _npy_into_npz(self.npy, self.path),
                f"write {self.path}")
        if self.ctx.runtime.is_main:
            LOGGER.info("every sample saved to %s (arr_0, uint8 NHWC)", self.path)
        return {}

    def outputs(self) -> Dict[str, str]:
        return {} if self.path is None else {"samples_npz": self.path}
