"""Whether a training run compiles its model: `model.compile` true, false or auto.

torch.compile pays its cost once per run (the run directory keeps the compiled code across
restarts, rebm.distributed.compile_cache) and saves a share of every step after it. `auto`
compiles when the run plans at least `REPAYING_STEPS` optimizer steps. The measured break-evens
(`benchmarks/bench_train.py breakeven`, docs/performance.md "When `auto` compiles") range from a
few hundred steps (the CIFAR model on a GPU) to a few thousand (a model too small to gain much);
a wrong "on" costs at most the compilation, once, while a wrong "off" costs the saving at every
step, so the threshold sits low in that range.

The decision depends only on the config (its planned length) and the device type, never on a
timing: the same config compiles or not on any number of processes and after any restart, so
DDP == one process and bitwise resume hold with `auto` as with an explicit value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import torch

# The shipped CIFAR runs plan 39 000 steps, the quickstart 220, tests a few.
REPAYING_STEPS = 2000
# Devices inductor compiles for; elsewhere (mps, ...) auto stays off.
COMPILING_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class CompileChoice:
    """Whether to compile, and why (the start-up line prints both)."""

    enabled: bool
    reason: str

    def describe(self) -> str:
        return f"{'on' if self.enabled else 'off'} ({self.reason})"


def decide_compile(setting: Union[bool, str], device: torch.device, planned_steps: float
                   ) -> CompileChoice:
    """`model.compile` -> whether this run compiles. `planned_steps`: the optimizer steps the
    run trains to from its start (inf without a limit; 0 for a model built only to be
    evaluated)."""
    if isinstance(setting, bool):
        return CompileChoice(setting, f"model.compile={str(setting).lower()}")
    if setting != "auto":
        raise ValueError(f"model.compile must be true, false or auto, got {setting!r}")
    if device.type not in COMPILING_DEVICES:
        return CompileChoice(False, f"model.compile=auto: not on {device.type}")
    steps = "no step limit" if math.isinf(planned_steps) else f"{int(planned_steps)} planned steps"
    if planned_steps >= REPAYING_STEPS:
        return CompileChoice(True, f"model.compile=auto: {steps}, a compile repays itself "
                                   f"after ~{REPAYING_STEPS}")
    return CompileChoice(False, f"model.compile=auto: {steps}, fewer than the ~{REPAYING_STEPS} "
                                "that repay a compile; model.compile=true forces it")
