"""One DAT update at a fixed T outside a run, as the Trainer's step makes it (rebm.engine.step):
for tests that look at a step's losses, negatives, scores or updated weights."""

from __future__ import annotations

from typing import List

import torch

from rebm.config import BatchPlan, TrainConfig
from rebm.data import MicroBatch
from rebm.distributed.parallel import unwrap
from rebm.distributed.precision import Precision
from rebm.engine.parts import Parts, Progress
from rebm.engine.step import update_all_ranks
from rebm.methods.base import StepResult
from rebm.methods.dat import DAT


def dat_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               micro_batches: List[MicroBatch], outdist_steps: int, cfg: TrainConfig,
               plan: BatchPlan, precision: Precision, log_now: bool = False) -> StepResult:
    """The update of one DAT step with T = `outdist_steps` (no scheduler, EMA or curriculum:
    those follow an applied update in the Trainer)."""
    training_method = DAT(cfg.method, cfg.model, cfg.schedule)
    training_method.curriculum.T = outdist_steps
    parts = Parts(model=model, raw_model=unwrap(model), optimizer=optimizer, scheduler=None,
                  ema=None, precision=precision, training_method=training_method,
                  progress=Progress(),
                  max_grad_norm=cfg.optimization.max_grad_norm)
    return update_all_ranks(parts, plan, micro_batches, log_now=log_now)
