"""The optimizer section and its registry: `optimizer`, `lr`, `wd` of the config.

The section is what an optimizer is built from; `OPTIMIZERS` holds the optimizers by name, for
validation (an unknown `optimizer` is one line at load, naming the choices). The builders, which
import torch's optimizers, live in rebm/engine/optimizers.py and register themselves there; the
registry knows that module only by name and imports it on its first lookup, so rebm.config never
imports rebm.engine in code and the layers hold. Importing this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from rebm.registry import Registry


@dataclass(frozen=True)
class OptimizerSection:
    """The config keys an optimizer is built from (top-level keys of the original schema)."""

    name: str  # `optimizer`, exactly as registered (the original's `match` refuses SGD too)
    lr: float  # `lr`
    wd: float  # `wd`


OptimizerBuilder = Callable[[Iterable, OptimizerSection], Any]
OPTIMIZERS: Registry[OptimizerBuilder] = Registry("optimizer", "rebm.engine.optimizers")
