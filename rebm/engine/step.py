"""The update of one optimizer step, in torchtitan's `train_step` shape (docs/design.md §6).

zero_grad; for each micro-batch the method's loss (forward only, `Method.micro_loss`) and its
backward, divided by the accumulation count, under `no_sync` but for the last (DDP all-reduces
the gradients once per step); optional gradient clipping (`max_grad_norm`); the optimizer step
through the precision object, which skips a non-finite update. `Trainer.train_step_all_ranks`
calls this and then, if and only if the update was applied, moves the scheduler, EMA, counter and
the method's `after_step_all_ranks`. Methods never call backward or an optimizer step.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from rebm.data import MicroBatch
from rebm.distributed.parallel import attack_view, micro_step_sync, scoring_view
from rebm.distributed.precision import Precision
from rebm.methods.base import Method, StepContext, StepResult


def step_context(model: torch.nn.Module, precision: Precision) -> StepContext:
    """What a method's loss runs on: the training wrapper, the attacks' view of it, the view
    its no-grad scores use and the run's autocast."""
    return StepContext(model=model, attacked=attack_view(model), autocast=precision.autocast,
                       scorer=scoring_view(model))


def update_all_ranks(ctx: StepContext, method: Method, optimizer: torch.optim.Optimizer,
                     precision: Precision, micro_batches: List[MicroBatch],
                     accumulation_steps: int, *, log_now: bool = False,
                     max_grad_norm: Optional[float] = None) -> StepResult:
    """One optimizer update over this rank's micro-batches; returns the method's result with
    `applied` (finite gradients, the same on every rank after DDP's all-reduce) and, when
    clipping, `grad_norm` (before clipping). Every rank calls this: the last micro-batch's
    backward all-reduces the gradients under DDP."""
    optimizer.zero_grad(set_to_none=True)
    outputs = []
    device = ctx.device
    for index, batch in enumerate(micro_batches):
        batch = batch.to(device, non_blocking=True)  # pinned by the loader on CUDA
        with micro_step_sync(ctx.model, last=index == len(micro_batches) - 1):
            out = method.micro_loss(ctx, batch, index, log_now)
            precision.backward(out.loss / accumulation_steps)
        outputs.append(out)
    grad_norm = None
    if max_grad_norm is not None:
        grad_norm = float(precision.clip_grad_norm(optimizer, max_grad_norm))
    applied = precision.step(optimizer)
    result = method.step_result(outputs, micro_batches)
    result.applied, result.grad_norm = applied, grad_norm
    return result
