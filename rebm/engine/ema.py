"""Exponential moving average of the weights, via the ema-pytorch package, with the original's
warm-up.

The EMA copy lives outside DDP (it wraps the unwrapped module) and is updated after every
optimizer step with the same weights on every rank, so it is identical on all ranks without any
communication. Its first update copies the weights; the n-th after that averages with decay
min(ema_decay, (1 + n) / (10 + n)), the original's (DAT's train.py builds
InNOutRobustness' AveragedModel, utils/average_model.py `update_parameters`), so early averages
are not dominated by the random initialisation and a run's EMA weights are the original's.
ema-pytorch's own warm-up, 1 - (1 + n)^(-2/3), would leave them far from the original's for
thousands of steps (0.93 against 0.85 at step 50; tests/test_original_trajectory.py)."""

from __future__ import annotations

from typing import Optional

import torch
from ema_pytorch import EMA

from rebm.config.sections import EmaSection


class OriginalWarmupEMA(EMA):
    """ema-pytorch's EMA whose decay at its n-th average is the original's warm-up."""

    def get_current_decay(self) -> float:
        # ema-pytorch's step counts update() calls; the first only copies the weights (n = 0)
        n = int((self.step - self.update_after_step - 1).clamp(min=0).item())
        if n <= 0:
            return 0.0
        return min(self.beta, (1 + n) / (10 + n))


def build_ema(raw_model: torch.nn.Module, ema: EmaSection) -> Optional[EMA]:
    if not ema.use_ema:
        return None
    average = OriginalWarmupEMA(
        raw_model,
        beta=ema.ema_decay,
        update_after_step=0,
        update_every=1,
        include_online_model=False,  # the state dict holds the average only
        allow_different_devices=True,
    )
    average.to(next(raw_model.parameters()).device)
    return average
