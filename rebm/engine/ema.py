"""Exponential moving average of the weights, via the ema-pytorch package.

The EMA copy lives outside DDP (it wraps the unwrapped module) and is updated after every
optimizer step with the same weights on every rank, so it is identical on all ranks without any
communication. Decay warms up (1 - (1 + step)^(-2/3), capped at `ema_decay`) so early averages
are not dominated by the random initialisation."""

from __future__ import annotations

from typing import Optional

import torch
from ema_pytorch import EMA

from rebm.config.sections import EmaSection


def build_ema(raw_model: torch.nn.Module, ema: EmaSection) -> Optional[EMA]:
    if not ema.use_ema:
        return None
    average = EMA(
        raw_model,
        beta=ema.ema_decay,
        update_after_step=0,
        update_every=1,
        include_online_model=False,  # the state dict holds the average only
        allow_different_devices=True,
    )
    average.to(next(raw_model.parameters()).device)
    return average
