"""AutoAttack accuracy (registered metric "autoattack"), through the authors' implementation
(`pyautoattack` on PyPI, MIT; a dependency of rebm).

The standard version (APGD-CE, APGD-T, FAB-T, Square; 1 restart, 100 iterations, 5000 queries)
under the `indist_attack_clf` norm (L2 or Linf) and eps, seeded with `rand_seed`. The library is
run on each test chunk (one evaluation batch, chunk k on rank k % W) as
`AutoAttack(...).run_standard_evaluation(x, y, batch_size=len(x))`: it reseeds its random numbers
per call, so a chunk's result does not depend on the world size, and equals the library called on
that chunk directly. The torch RNG the library reseeds is restored afterwards (training's own
random stream is untouched). The value is the fraction of test images still classified correctly.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor

from rebm.config.views import EvaluationSection
from rebm.distributed.logs import progress_enabled
from rebm.eval.metric import EvalContext, TestBatch
from rebm.eval.metrics.accuracy import CorrectCount
from rebm.eval.test_set import describe_test_set, test_set_settings

VERSION = "standard"
NORMS = ("L2", "Linf")
LOGGER = logging.getLogger("rebm")


def library_version() -> str:
    try:
        import pyautoattack
    except ImportError:
        return "missing"
    return pyautoattack.__version__


class AutoAttackAccuracy(CorrectCount):
    name = "autoattack"
    key = "autoattack_test_acc"
    summary = (("autoattack_test_acc", "AutoAttack acc", "{:.3f}"),)

    @classmethod
    def settings(cls, evaluation: EvaluationSection) -> Dict[str, Any]:
        attack = evaluation.method.indist_attack_clf
        return {"library": f"pyautoattack {library_version()}", "version": VERSION,
                "norm": attack.norm, "eps": attack.eps, "seed": evaluation.schedule.rand_seed,
                **test_set_settings(evaluation)}

    @classmethod
    def problems(cls, evaluation: EvaluationSection) -> List[str]:
        attack, found = evaluation.method.indist_attack_clf, []
        if library_version() == "missing":
            found.append("AutoAttack needs the pyautoattack package (a dependency of rebm): "
                         "pip install pyautoattack")
        if attack.norm not in NORMS or not math.isfinite(attack.eps):
            found.append(f"AutoAttack needs an L2 or Linf threat model with a finite eps; "
                         f"indist_attack_clf is {attack.norm} eps {attack.eps}")
        return found

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        from pyautoattack import AutoAttack

        attack = ctx.evaluation.method.indist_attack_clf
        self.attack = AutoAttack(ctx.model, norm=attack.norm, eps=attack.eps,
                                 seed=ctx.evaluation.schedule.rand_seed, version=VERSION,
                                 device=ctx.runtime.device)
        self.chunks_done = 0
        self.report_attacks()

    def report_attacks(self) -> None:
        """The library's per-attack messages are debug logs of its 'auto-attack' logger. With
        progress on, rank 0 turns "robust accuracy after <attack>" into a progress line of its
        own (an attack on one chunk takes minutes at paper scale); otherwise they are silent."""
        library = self.attack.logger
        for handler in [h for h in library.handlers if isinstance(h, AttackProgress)]:
            library.removeHandler(handler)  # one AutoAttack metric reports at a time
        if self.ctx.runtime.is_main and progress_enabled():
            library.setLevel(logging.DEBUG)
            library.propagate = False
            library.addHandler(AttackProgress(self))
        else:
            library.setLevel(logging.WARNING)

    def correct(self, batch: TestBatch) -> Tensor:
        devices = [batch.x.device] if batch.x.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            _, y_adv = self.attack.run_standard_evaluation(batch.x, batch.y,
                                                           batch_size=batch.x.shape[0])
        return y_adv.to(batch.y.device) == batch.y

    def update(self, batch: TestBatch) -> None:
        """Count the chunk; with progress bars on (a terminal, or REBM_PROGRESS=1), rank 0 says
        how far its chunks are, as a line above the evaluation's bar: a chunk takes minutes."""
        super().update(batch)
        self.chunks_done += 1
        if self.ctx.runtime.is_main and progress_enabled():
            robust, done = (int(v) for v in self.counts.tolist())
            LOGGER.info("AutoAttack on rank 0: chunk %d done, %d images, %d robust so far "
                        "(%.1f%%)", self.chunks_done, done, robust, 100.0 * robust / done)

    @classmethod
    def describe(cls, results, settings) -> List[Tuple[str, str, str]]:
        return [("AutoAttack accuracy", f"{results[cls.key]:.4f}",
                 f"{settings['library']} {settings['version']}, {settings['norm']} eps "
                 f"{settings['eps']:g}, seed {settings['seed']}; "
                 + describe_test_set(settings, results.get("n_test")))]


class AttackProgress(logging.Handler):
    """Rank 0's line after each attack of a chunk, from the library's own debug message."""

    PREFIX = "robust accuracy after "

    def __init__(self, metric: AutoAttackAccuracy):
        super().__init__(logging.DEBUG)
        self.metric = metric

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith(self.PREFIX):  # "APGD-CE: 45.31% (total time 3.2 s)"
            LOGGER.info("AutoAttack on rank 0: chunk %d, robust after %s",
                        self.metric.chunks_done + 1, text[len(self.PREFIX):])
