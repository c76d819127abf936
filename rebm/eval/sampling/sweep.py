"""DAT's adaptive step sweep: pick the number of generation steps by FID (docs/evaluation.md).

With `image_log.adaptive_steps`, each FID evaluation first generates `sweep_num_samples` samples
for every candidate step count (`image_log.step_sweep_range`, else num_steps - sweep_radius ...
num_steps + sweep_radius, clipped at 1), computes the FID of each, and generates the full
`num_samples` at the step count with the lowest FID (the fewest steps on a tie). The candidates'
samples are the same seeds with the same labels, generated sharded over the ranks like every
sample, so the choice is the same on any world size; rank 0's choice is broadcast all the same.
"""

from __future__ import annotations

import logging
import math
from typing import Dict, List, Tuple

from rebm.distributed import broadcast_object
from rebm.eval.features.fid import FIDScorer, MomentSums
from rebm.eval.metric import EvalContext
from rebm.eval.sampling.samples import stream_samples_all_ranks

LOGGER = logging.getLogger("rebm")


def sweep_candidates(image_log) -> List[int]:
    """The step counts the sweep tries, ascending, without repeats, each >= 1."""
    if image_log.step_sweep_range:
        steps = [int(s) for s in image_log.step_sweep_range]
    else:
        radius = max(0, int(image_log.sweep_radius))
        steps = list(range(image_log.num_steps - radius, image_log.num_steps + radius + 1))
    return sorted({max(1, s) for s in steps})


class _FeatureSums:
    """Feeds the generated chunks' features into one MomentSums (a sweep candidate)."""

    def __init__(self, scorer: FIDScorer):
        self.scorer, self.sums = scorer, MomentSums()

    def update(self, chunk) -> None:
        self.scorer.add_pixels(self.sums, chunk.pixels())


def sweep_steps_all_ranks(ctx: EvalContext, seeds, scorer: FIDScorer
                          ) -> Tuple[int, Dict[int, float]]:
    """(best step count, {step count: FID of its sweep samples}). A candidate whose FID cannot
    be computed counts as +inf; when none can, the configured num_steps stays. Every rank must
    call this."""
    log = ctx.evaluation.image_log
    candidates = sweep_candidates(log)
    LOGGER.info("FID step sweep: steps %s, %d samples each", candidates, log.sweep_num_samples)
    fids: Dict[int, float] = {}
    for steps in candidates:
        sink = _FeatureSums(scorer)
        stream_samples_all_ranks(ctx, seeds, [sink], log.sweep_num_samples, steps,
                                 what=f"sweep {steps} steps")
        value = scorer.score_all_ranks(sink.sums)
        fids[steps] = math.inf if value is None else value
        LOGGER.info("FID step sweep: %d steps -> FID %.4f", steps, fids[steps])
    finite = {s: v for s, v in fids.items() if math.isfinite(v)}
    best = min(finite, key=lambda s: (finite[s], s)) if finite else log.num_steps
    best = broadcast_object(ctx.runtime, best)
    LOGGER.info("FID step sweep: best %d steps", best)
    return best, fids
