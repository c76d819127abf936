"""The update of one optimizer step, in torchtitan's `train_step` shape (docs/design.md §6).

zero_grad; for each micro-batch the method's loss (forward only, `Method.micro_loss`) and its
backward, divided by the accumulation count, under `no_sync` but for the last (DDP all-reduces
the gradients once per step); optional gradient clipping (`max_grad_norm`); the optimizer step
through the precision object, which skips a non-finite update. `Trainer.train_step_all_ranks`
calls this and then, if and only if the update was applied, moves the scheduler, EMA, counter and
the method's `after_step_all_ranks`. Methods never call backward or an optimizer step.

The update takes the run's parts (method, optimizer, precision, the step context and the
clipping bound: rebm.engine.parts.Parts), the batch plan and the step's own inputs.
"""

from __future__ import annotations

from typing import List

from rebm.config import BatchPlan
from rebm.data import MicroBatch
from rebm.distributed.parallel import micro_step_sync
from rebm.engine.parts import Parts
from rebm.methods.base import StepResult


def update_all_ranks(parts: Parts, plan: BatchPlan, micro_batches: List[MicroBatch],
                     log_now: bool = False) -> StepResult:
    """One optimizer update over this rank's micro-batches (`plan.accumulation_steps` of them);
    returns the method's result with `applied` (finite gradients, the same on every rank after
    DDP's all-reduce) and, when clipping (`parts.max_grad_norm`), `grad_norm` (before clipping).
    `log_now`: the step's metrics are logged (the method computes its log-only values). Every
    rank calls this: the last micro-batch's backward all-reduces the gradients under DDP."""
    ctx, training_method, optimizer, precision = (parts.step_context, parts.training_method,
                                                  parts.optimizer, parts.precision)
    accumulation_steps, max_grad_norm = plan.accumulation_steps, parts.max_grad_norm
    optimizer.zero_grad(set_to_none=True)
    outputs = []
    device = ctx.device
    for index, batch in enumerate(micro_batches):
        batch = batch.to(device, non_blocking=True)  # pinned by the loader on CUDA
        with micro_step_sync(ctx.model, last=index == len(micro_batches) - 1):
            out = training_method.micro_loss(ctx, batch, index, log_now)
            precision.backward(out.loss / accumulation_steps)
        outputs.append(out)
    grad_norm = None
    if max_grad_norm is not None:
        grad_norm = float(precision.clip_grad_norm(optimizer, max_grad_norm))
    applied = precision.step(optimizer)
    result = training_method.step_result(outputs, micro_batches)
    result.applied, result.grad_norm = applied, grad_norm
    return result
