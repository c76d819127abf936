"""Mixed precision of a training step: autocast and, for fp16, a GradScaler."""

from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch
import torch.distributed as dist

LOGGER = logging.getLogger("rebm")


def gradients_finite(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every gradient the optimizer would apply is finite (one norm over all of them;
    under DDP the gradients are already all-reduced, so every rank gets the same answer)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None]
    return not grads or bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))


def native_on_cpu(mode: str) -> bool:
    """Whether this CPU computes `mode` (bf16 / fp16) natively (AVX512-BF16, AVX512-FP16, AMX);
    without it oneDNN emulates the type and autocast makes every step several times slower
    than fp32 (5-8x for the quickstart model on an AVX2 CPU). True when torch cannot tell."""
    probe = {"bf16": "_is_mkldnn_bf16_supported", "fp16": "_is_mkldnn_fp16_supported"}[mode]
    try:
        return bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):
        return True


class Precision:
    """autocast + (for fp16) GradScaler. bf16 needs no scaler; 'none' is plain fp32."""

    def __init__(self, mode: str, device: torch.device):
        self.mode = mode
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type, enabled=(mode == "fp16"))
        if device.type == "cpu" and mode != "none" and not native_on_cpu(mode):
            first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
            LOGGER.log(logging.WARNING if first else logging.INFO,  # one console line a run
                       "amp=%s: this CPU has no native %s, so autocast emulates it and every "
                       "step runs several times slower than amp=none; use amp=none here",
                       mode, mode)

    def autocast(self):
        if self.mode == "none":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.mode == "bf16" else torch.float16
        return torch.autocast(self.device_type, dtype=dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Scale the gradients to a total norm of at most `max_norm` (fp16: unscaled first, so
        the bound is on the true gradients); returns the norm before clipping. Non-finite
        gradients stay non-finite, and `step` then skips the update."""
        if self.scaler.is_enabled():
            self.scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """The optimizer step, never with non-finite gradients; returns whether the update
        counts as applied. fp16's GradScaler skips a step with non-finite gradients and lowers
        its scale (normal for fp16: the step counts as applied); otherwise such a step is
        skipped and False returned, which stops the run (rebm.engine.trainer)."""
        if self.scaler.is_enabled():
            self.scaler.step(optimizer)
            self.scaler.update()
            return True
        if not gradients_finite(optimizer):
            return False
        optimizer.step()
        return True

    def state_dict(self) -> Optional[dict]:
        return self.scaler.state_dict() if self.scaler.is_enabled() else None

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state:
            self.scaler.load_state_dict(state)
