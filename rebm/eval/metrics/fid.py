"""FID of the generated samples (registered metric "fid"; the pieces are in
rebm/eval/features/fid.py and rebm/eval/sampling/sweep.py).

Each generated chunk's features (pytorch-fid's Inception pool3 of the 8-bit samples, or the
REBM_FID_FEATURES stand-in) go into exact sums (`MomentSums`, rebm/eval/exact_sums.py);
`finish_all_ranks` adds up the ranks' and computes the Fréchet distance to `image_log.data_dir`:
the same value on any number of processes, bit for bit, as long as the evaluation batch (the
chunk) is the same. With `image_log.adaptive_steps` the step sweep runs
before the generation pass (`generation_steps_all_ranks`: its own generation passes, same
chunks) and fixes the main pass's step count. A missing weights or statistics file stops the
evaluation before any work (`problems`); the network and the statistics are loaded once per
Evaluator (`build`).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from rebm.config.views import EvaluationSection
from rebm.eval.features.fid import MomentSums, fid_scorer, reference_problems, weights_files
from rebm.eval.features.network import network_description, network_key, shown_as
from rebm.eval.metric import SAMPLES, EvalContext, Metric, SampleChunk
from rebm.eval.sampling.samples import describe_samples, sample_files, sample_settings, seed_source
from rebm.eval.sampling.sweep import sweep_candidates, sweep_steps_all_ranks


class FID(Metric):
    name = "fid"
    summary = (("fid", "FID", "{:.2f}"),)
    source = SAMPLES
    # 2: floor pixels by default (eval.sample_pixels), unblurred seeds unless
    # image_log.blur_fid_seeds, unconditional samples under logsumexp_sampling
    # 3: exact sums (rebm/eval/exact_sums.py): the same bits on any world size, where values
    # cached by 2 moved with the world size by round-off
    protocol = 3

    @classmethod
    def settings(cls, evaluation: EvaluationSection) -> Dict[str, Any]:
        log = evaluation.image_log
        sweep = ({"candidates": sweep_candidates(log), "sweep_num_samples": log.sweep_num_samples}
                 if log.adaptive_steps else None)
        return {"features": network_description(log), "reference": log.data_dir,
                "inception_weights": log.inception_weights, "quantized": "8 bit",
                "adaptive_steps": sweep, **sample_settings(evaluation)}

    @classmethod
    def files(cls, evaluation: EvaluationSection) -> Dict[str, Optional[str]]:
        return {"image_log.data_dir": evaluation.image_log.data_dir, **sample_files(evaluation),
                **weights_files(evaluation.image_log)}

    @classmethod
    def problems(cls, evaluation: EvaluationSection) -> List[str]:
        return reference_problems(evaluation) if evaluation.image_log.num_samples > 0 else []

    @classmethod
    def build(cls, evaluation: EvaluationSection, runtime, resources: Dict[str, Any]) -> None:
        if evaluation.image_log.num_samples > 0:  # the network and the statistics, loaded once
            fid_scorer(evaluation, runtime, 1, resources)

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        self.key = network_key(ctx.evaluation.image_log, "fid")
        self.scorer = fid_scorer(ctx.evaluation, ctx.runtime, ctx.batch_size, ctx.resources)
        self.sums = MomentSums()
        self.best: Optional[int] = None
        self.sweep: Dict[int, float] = {}

    def generation_steps_all_ranks(self) -> Optional[int]:
        """With image_log.adaptive_steps, the step sweep (its own generation passes)."""
        if self.ctx.evaluation.image_log.adaptive_steps:
            seeds = seed_source(self.ctx.evaluation, self.ctx.resources)
            self.best, self.sweep = sweep_steps_all_ranks(self.ctx, seeds, self.scorer)
        return self.best

    def update(self, chunk: SampleChunk) -> None:
        self.scorer.add_pixels(self.sums, chunk.pixels())

    def finish_all_ranks(self) -> Dict[str, Any]:
        results: Dict[str, Any] = {}
        if self.best is not None:
            results[f"{self.key}_best_steps"] = self.best
            results.update({f"{self.key}_sweep/{s}": v for s, v in self.sweep.items()})
        value = self.scorer.score_all_ranks(self.sums)
        if value is not None:
            results[self.key] = value
        return results

    @classmethod
    def describe(cls, results, settings) -> List[Tuple[str, str, str]]:
        key, mark = shown_as(settings["features"], "fid")
        if key not in results:
            return []
        label = f"FID, {mark}" if mark else "FID"
        reference = os.path.basename(settings["reference"] or "")
        return [(label, f"{results[key]:.4f}",
                 describe_samples(settings, results.get(f"{key}_best_steps"))
                 + f"; vs {reference}; {settings['features']}")]
