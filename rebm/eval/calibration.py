"""Expected calibration error with equal-width confidence bins (20 by default), sharded.

Bin b holds the predictions whose confidence (max softmax) lies in (b/B, (b+1)/B] (confidence 0
goes to bin 0). Per bin we keep three sums — count, sum of confidences, number correct — which
add up over ranks, so one all-reduce gives exactly the single-process ECE:

    ECE = Σ_b (n_b / N) · |acc_b − conf_b| = Σ_b |correct_b − Σconf_b| / N
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from rebm.distributed import Runtime, all_reduce_sum
from rebm.distributed.logs import progress
from rebm.distributed.parallel import unwrap
from rebm.eval.accuracy import eval_mode

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


def evaluate_ece(model: nn.Module, loader, runtime: Runtime, n_bins: int = N_BINS) -> float:
    """Clean-data ECE over all ranks' shards (every rank must call this: one all-reduce)."""
    model = unwrap(model)
    sums = torch.zeros(3, n_bins, dtype=torch.float64, device=runtime.device)
    with eval_mode(model), torch.no_grad():
        for x, y, _index in progress(loader, runtime, "calibration", total=len(loader)):
            probs = model(x.to(runtime.device)).softmax(dim=1)
            sums += calibration_bins(probs, y, n_bins)
    return ece_from_bins(all_reduce_sum(runtime, sums))
