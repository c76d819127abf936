"""Expected calibration error with equal-width confidence bins (20), sharded (metric "ece").

Bin b holds the predictions whose confidence (max softmax) lies in (b/B, (b+1)/B] (confidence 0
goes to bin 0). Per bin we keep three sums — count, sum of confidences, number correct — which
add up over ranks, so one all-reduce gives exactly the single-process ECE:

    ECE = Σ_b (n_b / N) · |acc_b − conf_b| = Σ_b |correct_b − Σconf_b| / N
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor

from rebm.distributed import all_reduce_sum
from rebm.eval.metric import TEST_SET, EvalContext, Metric, TestBatch
from rebm.eval.test_set import describe_test_set, test_set_settings

N_BINS = 20


def calibration_bins(probs: Tensor, labels: Tensor, n_bins: int = N_BINS) -> Tensor:
    """(3, n_bins) float64: [count, sum of confidences, number correct] per bin."""
    confidence, prediction = probs.detach().double().max(dim=1)
    bins = (torch.ceil(confidence * n_bins).long() - 1).clamp(0, n_bins - 1)
    correct = (prediction == labels.to(prediction.device)).double()
    sums = torch.zeros(3, n_bins, dtype=torch.float64, device=probs.device)
    sums[0].index_add_(0, bins, torch.ones_like(confidence))
    sums[1].index_add_(0, bins, confidence)
    sums[2].index_add_(0, bins, correct)
    return sums


def ece_from_bins(sums: Tensor) -> float:
    total = float(sums[0].sum())
    if total == 0:
        return math.nan
    return float((sums[2] - sums[1]).abs().sum()) / total


def expected_calibration_error(probs: Tensor, labels: Tensor, n_bins: int = N_BINS) -> float:
    """ECE of one set of predicted probabilities (N, K) and labels (N,)."""
    return ece_from_bins(calibration_bins(probs, labels, n_bins))


class Calibration(Metric):
    """Registered metric "ece": the clean predictions' expected calibration error."""

    name = "ece"
    source = TEST_SET

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        self.sums = torch.zeros(3, N_BINS, dtype=torch.float64, device=ctx.runtime.device)

    @classmethod
    def settings(cls, cfg) -> Dict[str, Any]:
        return {"bins": N_BINS, "binning": "equal-width", "confidence": "max softmax",
                **test_set_settings(cfg)}

    def update(self, batch: TestBatch) -> None:
        self.sums += calibration_bins(batch.logits().softmax(dim=1), batch.y, N_BINS)

    def finish(self) -> Dict[str, Any]:
        return {"ece": ece_from_bins(all_reduce_sum(self.ctx.runtime, self.sums))}

    @classmethod
    def describe(cls, results, settings) -> List[Tuple[str, str, str]]:
        return [("calibration error (ECE)", f"{results['ece']:.4f}",
                 f"{settings['bins']} equal-width bins of the max softmax; "
                 + describe_test_set(settings, results.get("n_test")))]
