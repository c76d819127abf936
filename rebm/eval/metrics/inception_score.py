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

Either way a rank keeps only its samples' logits (1008 floats a sample, or the stand-in's
features, rebm/eval/features/fidelity.py), never the images; they are gathered in index order at the end.
Stored as "inception_score" and "inception_score_std" (the std over the splits).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from rebm.eval.features.fid import feature_problems, standin_key, weights_files
from rebm.eval.features.fidelity import (
    FeatureRows,
    chunk_features,
    extract,
    feature_layer,
    fidelity_network_name,
    library_version,
    shared_extractor,
    text_order,
)
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


def split_scores(logits: Tensor, splits: int, seed: int) -> Tuple[float, float]:
    """torchmetrics' InceptionScore.compute on (N, C) logits, with its random permutation drawn
    from a generator seeded by `seed`: (mean, unbiased std) over the splits. torch.chunk makes
    ceil(N / splits) rows a split, so a small N has fewer splits."""
    permutation = torch.randperm(logits.shape[0], generator=torch.Generator().manual_seed(seed))
    features = logits[permutation]
    prob, log_prob = features.softmax(dim=1), features.log_softmax(dim=1)
    scores = []
    for p, log_p in zip(prob.chunk(splits, dim=0), log_prob.chunk(splits, dim=0), strict=True):
        marginal = p.mean(dim=0, keepdim=True)
        scores.append((p * (log_p - marginal.log())).sum(dim=1).mean().exp())
    stacked = torch.stack(scores)
    return float(stacked.mean()), float(stacked.std())


class InceptionScore(Metric):
    name = "inception_score"
    source = SAMPLES
    # 2: eval.is_resize (pil by default: the original's resize and split statistics),
    # eval.sample_pixels, unblurred seeds, logsumexp_sampling -> unconditional
    protocol = 2

    @classmethod
    def settings(cls, cfg) -> Dict[str, Any]:
        if cfg.eval.is_resize == "pil":
            protocol = {"resize": "PIL bilinear to 299 (the original's)",
                        "statistics": "torchmetrics' (float32, torch.chunk)",
                        "permutation_seed": cfg.rand_seed}
        else:
            protocol = {"resize": "torch-fidelity's own", "statistics": "torch-fidelity's",
                        "shuffle_seed": SHUFFLE_SEED}
        return {"library": library_version(), "is_resize": cfg.eval.is_resize, "splits": SPLITS,
                **protocol, "features": fidelity_network_name(), "quantized": "8 bit",
                **sample_settings(cfg)}

    @classmethod
    def files(cls, cfg) -> Dict[str, Optional[str]]:
        return {**sample_files(cfg), **weights_files(cfg.image_log.inception_weights)}

    @classmethod
    def problems(cls, cfg) -> List[str]:
        return feature_problems(cfg.image_log.inception_weights)

    @classmethod
    def build(cls, cfg, runtime, resources: Dict[str, Any]) -> None:
        shared_extractor(cfg, runtime, resources)  # the network, loaded once

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        self.key = standin_key("inception_score")
        self.pil = ctx.cfg.eval.is_resize == "pil"
        self.extractor = shared_extractor(ctx.cfg, ctx.runtime, ctx.resources)
        self.layer = feature_layer(self.extractor, "isc")
        self.rows = FeatureRows()

    def _logits(self, chunk: SampleChunk) -> Tensor:
        if not self.pil:
            return chunk_features(chunk, self.extractor)[self.layer]
        resized = pil_resize(chunk.pixels()).to(self.ctx.runtime.device)
        return extract(self.extractor, resized)[self.layer]

    def update(self, chunk: SampleChunk) -> None:
        self.rows.add(chunk.indices, self._logits(chunk))

    def finish(self) -> Dict[str, Any]:
        total = self.ctx.cfg.image_log.num_samples
        logits = self.rows.gather(self.ctx.runtime, total)
        if self.pil:
            mean, std = split_scores(logits, SPLITS, self.ctx.cfg.rand_seed)
            return {self.key: mean, f"{self.key}_std": std}
        from torch_fidelity.metric_isc import isc_features_to_metric

        score = isc_features_to_metric(logits[text_order(total)], splits=SPLITS, shuffle=True,
                                       rng_seed=SHUFFLE_SEED)
        return {self.key: score["inception_score_mean"],
                f"{self.key}_std": score["inception_score_std"]}

    @classmethod
    def describe(cls, results, settings) -> List[Tuple[str, str, str]]:
        standin = settings["features"].startswith("stand-in")
        key = "inception_score_standin" if standin else "inception_score"
        label = "Inception Score, STAND-IN features" if standin else "Inception Score"
        return [(label, f"{results[key]:.4f} ± {results[f'{key}_std']:.4f}",
                 f"{settings['splits']} splits, resize {settings['resize']}, "
                 f"{settings['library']}, {settings['features']}; "
                 + describe_samples(settings))]
