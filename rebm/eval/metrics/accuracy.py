"""Clean and robust test accuracy (registered metrics "accuracy" and "robust_accuracy").

Each rank counts the correct predictions of its test chunks; the counts are summed over ranks
with one all-reduce per metric, so the result equals a single-process evaluation on any world
size.

The robust attack is PGD on the cross-entropy with the `indist_attack_clf` threat model and
`robust_eval_steps` steps when set. Its random start (when `random_start` is set) is keyed by the
*dataset index* of each image, so an image gets the same start point whichever rank or batch it
lands in. The cross-entropy is the original's mean over ITS evaluation batch: it attacked the
test images in order, `batch_size` at a time, the last batch shorter (DAT's eval_robust_acc on
its test loader of batch_size through DataParallel; In-N-Out's test() likewise with its `bs`),
so an image's weight 1/N follows from its place in the list, not from rebm's chunks or ranks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from rebm.attacks.argmin_pgd import attack_from_config
from rebm.config.views import EvaluationSection
from rebm.data.indexing import sample_keys
from rebm.distributed import all_reduce_sum
from rebm.eval.metric import TEST_SET, EvalContext, Metric, TestBatch
from rebm.eval.test_set import describe_test_set, test_set_files, test_set_settings

# The "epoch" slot of sample_keys separates the random streams of the evaluation attacks.
ROBUST_EVAL_EPOCH = 0


def index_keys(seed: int, indices: Tensor, epoch: int = ROBUST_EVAL_EPOCH) -> Tensor:
    """Per-sample attack keys from (seed, dataset index): independent of rank and batch."""
    idx = np.asarray(indices.cpu(), dtype=np.int64)
    return torch.from_numpy(sample_keys(seed, "eval", epoch, idx))


def robust_eval_attack(evaluation: EvaluationSection):
    """The indist_attack_clf threat model, with `robust_eval_steps` PGD steps when set (robust
    evaluation usually wants more steps than adversarial training uses)."""
    if evaluation.eval.robust_eval_steps is None:
        return evaluation.method.indist_attack_clf
    return dataclasses.replace(evaluation.method.indist_attack_clf, max_steps=evaluation.eval.robust_eval_steps)


def original_eval_batch_sizes(positions: Tensor, n_images: int, batch_size: int) -> Tensor:
    """Per image (by its 0-based place among `n_images`), the size of the batch the original's
    evaluation attacked it in: batches of `batch_size` in order, the last one shorter."""
    starts = positions // batch_size * batch_size
    return (n_images - starts).clamp(max=batch_size)


def ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


class CorrectCount(Metric):
    """Base of accuracy metrics: counts correct predictions, one all-reduce at the end."""

    source = TEST_SET
    key = ""

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        self.counts = torch.zeros(2, dtype=torch.int64, device=ctx.runtime.device)

    @classmethod
    def files(cls, evaluation: EvaluationSection) -> Dict[str, Optional[str]]:
        return test_set_files(evaluation)

    def correct(self, batch: TestBatch) -> Tensor:
        raise NotImplementedError

    def update(self, batch: TestBatch) -> None:
        self.counts[0] += self.correct(batch).sum()
        self.counts[1] += batch.y.shape[0]

    def finish_all_ranks(self) -> Dict[str, Any]:
        correct, n = all_reduce_sum(self.ctx.runtime, self.counts).tolist()
        return {self.key: ratio(correct, n)}


class CleanAccuracy(CorrectCount):
    name = "accuracy"
    key = "test_acc"
    summary = (("test_acc", "clean acc", "{:.3f}"),)

    @classmethod
    def settings(cls, evaluation: EvaluationSection) -> Dict[str, Any]:
        return test_set_settings(evaluation)

    def correct(self, batch: TestBatch) -> Tensor:
        return batch.logits().argmax(1) == batch.y

    @classmethod
    def describe(cls, results, settings) -> List[Tuple[str, str, str]]:
        return [("clean accuracy", f"{results[cls.key]:.4f}",
                 describe_test_set(settings, results.get("n_test")))]


def attack_settings(attack) -> Dict[str, Any]:
    return {"norm": attack.norm, "eps": attack.eps, "steps": attack.max_steps,
            "step_size": attack.step_size, "random_start": attack.random_start}


class RobustAccuracy(CorrectCount):
    name = "robust_accuracy"
    key = "robust_test_acc"
    summary = (("robust_test_acc", "robust acc", "{:.3f}"),)

    @classmethod
    def settings(cls, evaluation: EvaluationSection) -> Dict[str, Any]:
        attack = robust_eval_attack(evaluation)
        name = "argmin PGD" if attack.attack_type == "argmin_pgd" else "PGD"  # the cache's key
        return {"attack": name, "loss": "cross-entropy",
                **attack_settings(attack), "attack_batch": evaluation.schedule.batch_size,
                "seed": evaluation.schedule.rand_seed,
                **test_set_settings(evaluation)}

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        self.attack = robust_eval_attack(ctx.evaluation)

    def correct(self, batch: TestBatch) -> Tensor:
        schedule = self.ctx.evaluation.schedule
        keys = index_keys(schedule.rand_seed, batch.index).to(batch.x.device)
        sizes = original_eval_batch_sizes(batch.positions, batch.n_images, schedule.batch_size)
        x_adv = attack_from_config(batch.model, batch.x, self.attack, objective="ce", y=batch.y,
                                   random_start_keys=keys, ce_batch_sizes=sizes)
        with torch.no_grad():
            return batch.model(x_adv).argmax(1) == batch.y

    @classmethod
    def describe(cls, results, settings) -> List[Tuple[str, str, str]]:
        start = ", random start" if settings["random_start"] else ""
        return [("robust accuracy", f"{results[cls.key]:.4f}",
                 f"{settings['attack']}-{settings['steps']} {settings['norm']} eps {settings['eps']:g}, step "
                 f"{settings['step_size']:g}{start}; "
                 + describe_test_set(settings, results.get("n_test")))]
