"""Expected calibration error with equal-width confidence bins (20), sharded (metric "ece").

Bin b holds the predictions whose confidence (max softmax) lies in (b/B, (b+1)/B] (confidence 0
goes to bin 0). Per bin we keep three sums — count, sum of confidences, number correct — which
add up over ranks, so one all-reduce gives exactly the single-process ECE:

    ECE = Σ_b (n_b / N) · |acc_b − conf_b| = Σ_b |correct_b − Σconf_b| / N

With a run directory, rank 0 also draws the reliability diagram of the same bins
(<run_dir>/reliability.png; reliability_step<step>.png in training), with matplotlib.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from rebm.config.views import EvaluationSection
from rebm.distributed.collectives import on_main
from rebm.eval.exact_sums import ExactSums
from rebm.eval.files import write_replacing
from rebm.eval.metric import TEST_SET, EvalContext, Metric, TestBatch
from rebm.eval.test_set import describe_test_set, test_set_files, test_set_settings

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





def reliability_diagram(sums: Tensor, ece: float, path: str) -> None:
    """The reliability diagram of the bin sums as a PNG: accuracy per confidence bin against
    the diagonal (perfect calibration), the gap hatched, and below it the share of images per
    bin. Rank 0 only calls this."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    count, confidence, correct = (sums[i].numpy() for i in range(3))
    bins = len(count)
    left = [b / bins for b in range(bins)]
    filled = count > 0
    accuracy = [c / n if n else 0.0 for c, n in zip(correct, count, strict=True)]
    mean_conf = [c / n if n else 0.0 for c, n in zip(confidence, count, strict=True)]
    figure = Figure(figsize=(4.5, 5.5))
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.bar(left, accuracy, width=1 / bins, align="edge", edgecolor="black", label="accuracy")
    # The gap as a hatched outline, not a fill: where accuracy exceeds confidence it lies over
    # the accuracy bar, which stays readable through it.
    top.bar(left, [c - a if f else 0 for c, a, f in zip(mean_conf, accuracy, filled, strict=True)],
            bottom=accuracy, width=1 / bins, align="edge", fill=False, edgecolor="tab:red",
            hatch="//", linewidth=1, label="gap to confidence")
    top.plot([0, 1], [0, 1], "k--", linewidth=1)
    top.set(ylabel="accuracy", xlim=(0, 1), ylim=(0, 1),
            title=f"ECE {ece:.4f} ({int(count.sum())} images, {bins} bins)")
    top.legend(loc="upper left")
    bottom.bar(left, count / max(count.sum(), 1), width=1 / bins, align="edge",
               edgecolor="black")
    bottom.set(xlabel="confidence (max softmax)", ylabel="share of images")
    figure.tight_layout()
    write_replacing(path, lambda tmp: figure.savefig(tmp, dpi=100, format="png"))


class Calibration(Metric):
    """Registered metric "ece": the clean predictions' expected calibration error."""

    name = "ece"
    summary = (("ece", "ECE", "{:.3f}"),)
    source = TEST_SET

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        self.sums = ExactSums()  # the same bins on any world size (rebm/eval/exact_sums.py)

    @classmethod
    def settings(cls, evaluation: EvaluationSection) -> Dict[str, Any]:
        return {"bins": N_BINS, "binning": "equal-width", "confidence": "max softmax",
                **test_set_settings(evaluation)}

    @classmethod
    def files(cls, evaluation: EvaluationSection) -> Dict[str, Optional[str]]:
        return test_set_files(evaluation)

    def update(self, batch: TestBatch) -> None:
        self.sums.add(calibration_bins(batch.logits().softmax(dim=1), batch.y, N_BINS))

    def finish_all_ranks(self) -> Dict[str, Any]:
        total = self.sums.total_all_ranks(self.ctx.runtime)
        sums = torch.zeros(3, N_BINS, dtype=torch.float64) if total is None else total.cpu()
        ece = ece_from_bins(sums)
        if self.ctx.run_dir is not None:
            path = self.ctx.run_dir.reliability_diagram(self.ctx.step)
            on_main(self.ctx.runtime, lambda: reliability_diagram(sums, ece, path),
                    f"write {path}")
        return {"ece": ece}

    def outputs(self) -> Dict[str, str]:
        if self.ctx.run_dir is None:
            return {}
        return {"reliability_diagram": self.ctx.run_dir.reliability_diagram(self.ctx.step)}

    @classmethod
    def describe(cls, results, settings) -> List[Tuple[str, str, str]]:
        return [("calibration error (ECE)", f"{results['ece']:.4f}",
                 f"{settings['bins']} equal-width bins of the max softmax; "
                 + describe_test_set(settings, results.get("n_test")))]
