"""OOD-detection AUROC against `data.outdist_dataset` (registered metric "ood"), on the test pass.

In-distribution scores come from the shared test pass (the clean logits of each batch); the
out-distribution's first `n_test` images are scored in `finish_all_ranks`
(rebm/eval/metrics/ood_sets.py: the loader, the scores, the padded gather). The score is
logsumexp of the logits for energy models (`logsumexp: true`), else the max softmax, in float32
as the original's; the out-distribution is read at the OOD side (`ood_image_size`: 224 px
for ImageNet models as the original's, the model's own side otherwise).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from rebm.auc import binary_auc
from rebm.config.views import EvaluationSection
from rebm.distributed import all_reduce_sum
from rebm.distributed.logs import progress
from rebm.distributed.signals import stop_points_all_ranks
from rebm.eval.metric import TEST_SET, EvalContext, Metric, TestBatch
from rebm.eval.metrics.ood_sets import (
    build_ood_data,
    gather_scores_all_ranks,
    ood_image_size,
    ood_score,
)
from rebm.eval.test_set import describe_test_set, test_set_settings

PROCEDURAL_OUTDISTS = ("noise", "uniform-noise", "lowfreq-noise")  # rebm.data.pipeline.outdist_source


def score_name(evaluation: EvaluationSection) -> str:
    return "lse" if evaluation.method.logsumexp else "max_softmax"


class OODDetection(Metric):
    name = "ood"
    summary = (("ood_auroc", "OOD AUROC", "{:.3f}"),)
    source = TEST_SET
    protocol = 2  # 2: float32 scores, the out-distribution at the original's OOD side

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        self.score = score_name(ctx.evaluation)
        self.scores: List[torch.Tensor] = []

    @classmethod
    def settings(cls, evaluation: EvaluationSection) -> Dict[str, Any]:
        return {"out_distribution": evaluation.data.outdist_dataset,
                "out_dir": evaluation.data.outdist_std_dir,
                "score": score_name(evaluation), "ood_images": "as many as test images",
                "image_size": ood_image_size(evaluation),
                **test_set_settings(evaluation)}

    @classmethod
    def files(cls, evaluation: EvaluationSection) -> Dict[str, Optional[str]]:
        """The out-distribution's file or folder (none for procedural noise)."""
        if evaluation.data.outdist_dataset in PROCEDURAL_OUTDISTS:
            return {}
        return {"data.outdist_std_dir": evaluation.data.outdist_std_dir}

    def update(self, batch: TestBatch) -> None:
        self.scores.append(ood_score(batch.logits(), self.score))

    def _local(self, scores: List[torch.Tensor]) -> torch.Tensor:
        device = self.ctx.runtime.device
        return torch.cat(scores) if scores else torch.zeros(0, dtype=torch.float64, device=device)

    def finish_all_ranks(self) -> Dict[str, Any]:
        ctx, rt = self.ctx, self.ctx.runtime
        positives = self._local(self.scores)
        n_test = int(all_reduce_sum(rt, torch.tensor([positives.shape[0]]))[0])
        loader = build_ood_data(ctx.evaluation, rt, ctx.batch_size, num_samples=n_test)
        negatives = []
        stops = stop_points_all_ranks(rt, len(loader))
        with torch.no_grad():
            for index, batch in enumerate(progress(loader, rt, "OOD scores", total=len(loader))):
                stops.check_all_ranks(index)
                negatives.append(ood_score(ctx.model(batch[0].to(rt.device)), self.score))
        pos = gather_scores_all_ranks(rt, positives)
        neg = gather_scores_all_ranks(rt, self._local(negatives))
        return {"ood_auroc": float(binary_auc(pos, neg)), "n_ood": int(neg.shape[0])}

    @classmethod
    def describe(cls, results, settings) -> List[Tuple[str, str, str]]:
        return [("OOD AUROC", f"{results['ood_auroc']:.4f}",
                 f"vs {settings['out_distribution']} ({results.get('n_ood')} images at "
                 f"{settings.get('image_size')} px), score "
                 f"{settings['score']}; " + describe_test_set(settings, results.get("n_test")))]
