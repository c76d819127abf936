"""Inception Score of the generated samples (registered metric "inception_score").

Two protocols, by `eval.is_resize`:

- "pil" (default), the original's path (its rebm/eval/metrics/inception_score.py, called by compute_fid
  on the folder of sample PNGs): each 8-bit sample is resized to 299 x 299 by PIL's bilinear
  filter (what torchvision's `Resize((299, 299))` does to a PIL image; ToTensor and `x * 255 ->
  uint8` after it give back the same bytes), fed to torch-fidelity's `inception-v3-compat`
  (the network inside torchmetrics' `InceptionScore`, feature `logits_unbiased`, 1008 classes),
  and the score is torchmetrics' computation: the logits in file order (= sample index order),
  permuted, float32 softmax, `torch.chunk` into 10 splits, exp(mean KL(p(y|x) || p(y))) per split,
  then the mean and the (unbiased) std over the splits. The original's permutation is
  `torch.randperm` on the unseeded global generator, so its IS changes from run to run; rebm
  seeds it with `rand_seed` (`torch.Generator().manual_seed(rand_seed)`).
- "fidelity": the samples at their own size into the same network (which resizes them to 299
  itself, TF1-style bilinear), scored by torch-fidelity's `isc_features_to_metric` with its
  defaults (10 splits, rows shuffled with seed 2020, float64), the rows in the order torch-fidelity
  reads the `keep_samples` folder: the value equals `fidelity --isc --input1 <that folder>`.

Either way no rank keeps logits or images: each chunk's logits (1008 floats a sample, or the
stand-in's features, rebm/eval/features/fidelity.py) go at once into its rank's split statistics
(`SplitStatistics`): per split, the sum of p(y|x) over its samples (C numbers), of
sum_y p log p, and the count. A sample's split is the one its position in the permuted order
falls in, from its sample index (the protocol's permutation of all N indices, on every rank).
One all-reduce of the splits x (C + 2) statistics gives every rank the scores: KL of a split =
(sum_x sum_y p log p - sum_y S_y log(S_y / n)) / n with S_y = sum_x p(y|x), the library's
mean KL(p(y|x) || p(y)) written in sums. The sums are exact (`ExactSums`, fixed point to 2^-84
in int64 digits, rebm/eval/exact_sums.py), so the result does not depend on the world size or
the order of the chunks; it equals the library's computation up to float64 round-off (~1e-15
relative; float32 for the "pil" path's softmax, as torchmetrics').
Stored as "inception_score" and "inception_score_std" (the std over the splits).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from rebm.config.views import EvaluationSection
from rebm.distributed import Runtime
from rebm.eval.exact_sums import ExactSums
from rebm.eval.features.fid import weights_files
from rebm.eval.features.fidelity import (
    chunk_features,
    extract,
    feature_layer,
    fidelity_network_name,
    library_version,
    shared_extractor,
    text_order,
)
from rebm.eval.features.network import network_key, network_problems, shown_as
from rebm.eval.metric import SAMPLES, EvalContext, Metric, SampleChunk
from rebm.eval.sampling.samples import describe_samples, sample_files, sample_settings

SPLITS = 10
SHUFFLE_SEED = 2020  # torch-fidelity's default rng_seed (is_resize: fidelity)
INCEPTION_SIZE = 299


def pil_resize(pixels: Tensor, size: int = INCEPTION_SIZE) -> Tensor:
    """uint8 (N, 3, H, W) images resized to size x size by PIL's bilinear filter, uint8, on the
    CPU: what torchvision's Resize((size, size)) does to a PIL image of each."""
    rows = pixels.permute(0, 2, 3, 1).cpu().numpy()
    resized = [np.asarray(Image.fromarray(row).resize((size, size), Image.BILINEAR))
               for row in rows]
    return torch.from_numpy(np.stack(resized)).permute(0, 3, 1, 2).contiguous()


def pil_split_of(n: int, splits: int, seed: int) -> Tensor:
    """Split of each sample index under the "pil" protocol: torchmetrics' permutation of the
    index order (torch.randperm from a generator seeded by `seed`), cut by torch.chunk into
    pieces of ceil(n / splits) rows (so a small n has fewer splits)."""
    permutation = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    size = -(-n // splits)
    split_of = torch.empty(n, dtype=torch.int8)
    split_of[permutation] = (torch.arange(n) // size).to(torch.int8)
    return split_of


def fidelity_split_of(n: int, splits: int) -> Tensor:
    """Split of each sample index under the "fidelity" protocol: torch-fidelity's
    `isc_features_to_metric` on the rows in file-name order, shuffled by
    np.random.RandomState(2020), split i = positions [i n / splits, (i+1) n / splits)."""
    order = np.asarray(text_order(n))[np.random.RandomState(SHUFFLE_SEED).permutation(n)]
    position_split = np.zeros(n, dtype=np.int8)
    for i in range(splits):
        position_split[i * n // splits:(i + 1) * n // splits] = i
    split_of = torch.empty(n, dtype=torch.int8)
    split_of[torch.from_numpy(order)] = torch.from_numpy(position_split)
    return split_of


class SplitStatistics:
    """A rank's per-split sums for the Inception Score (see the module's docstring), exact
    (rebm/eval/exact_sums.py): per split, the count, the sum of sum_y p log p and of p(y|x), as
    the rows (splits, 2 + C) of one ExactSums, each sample's values added to its split's row."""

    def __init__(self, split_of: Tensor, splits: int, softmax_dtype: torch.dtype):
        self.split_of, self.splits, self.dtype = split_of, splits, softmax_dtype
        self.sums = ExactSums(rows=splits)

    def add(self, indices: Tensor, logits: Tensor) -> None:
        features = logits.detach().cpu().to(self.dtype)
        p, log_p = features.softmax(dim=1).double(), features.log_softmax(dim=1).double()
        split = self.split_of[indices.cpu()].long()
        entropy = (p * log_p).sum(dim=1, keepdim=True)
        self.sums.add(torch.cat([torch.ones_like(entropy), entropy, p], dim=1), split)

    def scores_all_ranks(self, runtime: Runtime) -> Tuple[Tensor, Tensor]:
        """(exp(mean KL), sample count) of every split (float64, on every rank; an empty split's
        score is NaN, as the library's): the exact sums of all ranks, the same on any world
        size. Every rank must call this."""
        total = self.sums.total_all_ranks(runtime)
        if total is None:  # no sample on any rank
            return torch.full((self.splits,), float("nan"), dtype=torch.float64), \
                torch.zeros(self.splits, dtype=torch.float64)
        total = total.cpu()
        n, entropy, mass = total[:, 0], total[:, 1], total[:, 2:]
        cross = torch.xlogy(mass, mass / n[:, None]).sum(dim=1)  # sum_y S_y log(S_y / n)
        return ((entropy - cross) / n).exp(), n


class InceptionScore(Metric):
    name = "inception_score"
    summary = (("inception_score", "IS", "{:.2f}"),)
    source = SAMPLES
    # 2: eval.is_resize (pil by default: the original's resize and split statistics),
    # eval.sample_pixels, unblurred seeds, logsumexp_sampling -> unconditional
    protocol = 2

    @classmethod
    def settings(cls, evaluation: EvaluationSection) -> Dict[str, Any]:
        if evaluation.eval.is_resize == "pil":
            protocol = {"resize": "PIL bilinear to 299 (the original's)",
                        "statistics": "torchmetrics' (float32, torch.chunk)",
                        "permutation_seed": evaluation.schedule.rand_seed}
        else:
            protocol = {"resize": "torch-fidelity's own", "statistics": "torch-fidelity's",
                        "shuffle_seed": SHUFFLE_SEED}
        return {"library": library_version(), "is_resize": evaluation.eval.is_resize,
                "splits": SPLITS, **protocol,
                "features": fidelity_network_name(evaluation.image_log), "quantized": "8 bit",
                **sample_settings(evaluation)}

    @classmethod
    def files(cls, evaluation: EvaluationSection) -> Dict[str, Optional[str]]:
        return {**sample_files(evaluation), **weights_files(evaluation.image_log)}

    @classmethod
    def problems(cls, evaluation: EvaluationSection) -> List[str]:
        return network_problems(evaluation.image_log)

    @classmethod
    def build(cls, evaluation: EvaluationSection, runtime, resources: Dict[str, Any]) -> None:
        shared_extractor(evaluation, runtime, resources)  # the network, loaded once

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        self.key = network_key(ctx.evaluation.image_log, "inception_score")
        self.pil = ctx.evaluation.eval.is_resize == "pil"
        self.extractor = shared_extractor(ctx.evaluation, ctx.runtime, ctx.resources)
        self.layer = feature_layer(self.extractor, "isc")
        total = ctx.evaluation.image_log.num_samples
        if self.pil:  # torchmetrics' float32 softmax
            split_of, dtype = pil_split_of(total, SPLITS, ctx.evaluation.schedule.rand_seed), torch.float32
        else:  # torch-fidelity's float64
            split_of, dtype = fidelity_split_of(total, SPLITS), torch.float64
        self.statistics = SplitStatistics(split_of, SPLITS, dtype)

    def _logits(self, chunk: SampleChunk) -> Tensor:
        if not self.pil:
            return chunk_features(chunk, self.extractor)[self.layer]
        resized = pil_resize(chunk.pixels()).to(self.ctx.runtime.device)
        return extract(self.extractor, resized)[self.layer]

    def update(self, chunk: SampleChunk) -> None:
        self.statistics.add(chunk.indices, self._logits(chunk))

    def finish_all_ranks(self) -> Dict[str, Any]:
        scores, counts = self.statistics.scores_all_ranks(self.ctx.runtime)
        if self.pil:  # torchmetrics: the mean and the unbiased std of torch.chunk's pieces
            scores = scores[counts > 0]
            mean, std = float(scores.mean()), float(scores.std())
        else:  # torch-fidelity: np.mean and np.std (population) of the splits
            mean, std = float(np.mean(scores.tolist())), float(np.std(scores.tolist()))
        return {self.key: mean, f"{self.key}_std": std}

    @classmethod
    def describe(cls, results, settings) -> List[Tuple[str, str, str]]:
        key, mark = shown_as(settings["features"], "inception_score")
        label = f"Inception Score, {mark}" if mark else "Inception Score"
        return [(label, f"{results[key]:.4f} ± {results[f'{key}_std']:.4f}",
                 f"{settings['splits']} splits, resize {settings['resize']}, "
                 f"{settings['library']}, {settings['features']}; "
                 + describe_samples(settings))]
