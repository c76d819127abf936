"""`python -m rebm.eval.evaluate` with two more metrics, registered the way rebm's own are (a
`Metric` subclass in `METRICS`, rebm/eval/registry.py), for tests/test_eval_summary.py:
`python -m tests.evaluate_with_extra_metrics CONFIG model.ckpt_path=PATH ... --metrics
misclassified,mean_confidence` (under torchrun like the real entry point).

- `misclassified`: the number of misclassified test images; it declares its summary label.
- `mean_confidence`: the mean max-softmax probability; it declares nothing, so the summary
  shows it under its name (`Metric.summary_values`' default).
"""

from __future__ import annotations

import sys
from typing import Any, Dict

import torch

from rebm.distributed import all_reduce_sum
from rebm.eval import evaluate, registry
from rebm.eval.metric import TEST_SET, EvalContext, Metric, TestBatch


class Misclassified(Metric):
    name = "misclassified"
    source = TEST_SET
    summary = (("misclassified", "misclassified test images", "{:d}"),)

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        self.count = torch.zeros((), dtype=torch.int64, device=ctx.runtime.device)

    def update(self, batch: TestBatch) -> None:
        self.count += (batch.logits().argmax(1) != batch.y).sum()

    def finish_all_ranks(self) -> Dict[str, Any]:
        return {"misclassified": int(all_reduce_sum(self.ctx.runtime, self.count).item())}


class MeanConfidence(Metric):
    name = "mean_confidence"
    source = TEST_SET

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        # (sum of max-softmax probabilities, images), float64: a sum that any world size and
        # any batch order add to the same value at this precision
        self.sums = torch.zeros(2, dtype=torch.float64, device=ctx.runtime.device)

    def update(self, batch: TestBatch) -> None:
        confidence = batch.logits().softmax(dim=1).amax(dim=1).double()
        self.sums += torch.stack([confidence.sum(), torch.tensor(float(len(confidence)),
                                                                 dtype=torch.float64,
                                                                 device=confidence.device)])

    def finish_all_ranks(self) -> Dict[str, Any]:
        total, n = all_reduce_sum(self.ctx.runtime, self.sums).tolist()
        return {"mean_confidence": total / n}


# rebm's own metrics are registered by naming their class in the list that fills METRICS; a
# test cannot edit rebm/eval/registry.py, so it adds to the same registry before the entry point
# reads it (after rebm's own: metrics run and are reported in registration order).
for metric in (Misclassified, MeanConfidence):
    registry.METRICS.add(metric.name, metric)

if __name__ == "__main__":
    sys.exit(evaluate.main())
