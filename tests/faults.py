"""Fault injection for tests: DAT with NaN gradients or a slow step on one rank. Production code
knows nothing of it; tests start it through `python -m tests.faulty_train`."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional, Tuple

import torch
from torch import Tensor

from rebm.data import MicroBatch
from rebm.methods.base import MicroOutput, StepContext
from rebm.methods.dat import DAT


class _NanGradient(torch.autograd.Function):
    """Identity forward, NaN backward: a finite loss whose gradients are not."""

    @staticmethod
    def forward(ctx, loss: Tensor) -> Tensor:
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return torch.full_like(grad, float("nan"))


def parse_fault(spec: Optional[str], fields: int) -> Optional[Tuple[float, ...]]:
    """"STEP:RANK" or "STEP:RANK:SECONDS" -> numbers; None stays None."""
    if spec is None:
        return None
    values = tuple(float(v) for v in spec.split(":"))
    if len(values) != fields:
        raise ValueError(f"expected {fields} ':'-separated numbers, got '{spec}'")
    return values


class FaultyDAT(DAT):
    """DAT whose `nan_at = (step, rank)` gives the step-th optimizer step of this process on
    that rank a finite loss and NaN gradients (the engine's backward of its losses), and whose `slow_at = (step, rank, seconds)` makes
    that step on that rank sleep first (a slow or stuck rank)."""

    def __init__(self, method, model, schedule, nan_at: Optional[Tuple[float, ...]] = None,
                 slow_at: Optional[Tuple[float, ...]] = None):
        super().__init__(method, model, schedule)
        self.nan_at, self.slow_at = nan_at, slow_at
        self.steps_in_this_process = 0
        self.rank = int(os.environ.get("RANK", "0"))

    def _hits(self, fault: Optional[Tuple[float, ...]]) -> bool:
        return (fault is not None and int(fault[0]) == self.steps_in_this_process
                and int(fault[1]) == self.rank)

    def micro_loss(self, ctx: StepContext, batch: MicroBatch, index: int, log_now: bool
                   ) -> MicroOutput:
        if index == 0:  # a new optimizer step
            self.steps_in_this_process += 1
            if self._hits(self.slow_at):
                time.sleep(self.slow_at[2])
        out = super().micro_loss(ctx, batch, index, log_now)
        if self._hits(self.nan_at):
            out = dataclasses.replace(out, loss=_NanGradient.apply(out.loss))
        return out
