"""Mixed precision of a training step: autocast and, for fp16, a GradScaler."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch


class Precision:
    """autocast + (for fp16) GradScaler. bf16 needs no scaler; 'none' is plain fp32."""

    def __init__(self, mode: str, device: torch.device):
        self.mode = mode
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type, enabled=(mode == "fp16"))

    def autocast(self):
        if self.mode == "none":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.mode == "bf16" else torch.float16
        return torch.autocast(self.device_type, dtype=dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> Optional[dict]:
        return self.scaler.state_dict() if self.scaler.is_enabled() else None

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state:
            self.scaler.load_state_dict(state)
