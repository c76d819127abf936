"""The optimization section and the optimizers' registry: `optimizer`, `lr`, `wd`, `max_grad_norm`.

The section is what an optimizer is built from; `OPTIMIZERS` holds the optimizers by name, for
validation (an unknown `optimizer` is one line at load, naming the choices). The builders, which
import torch's optimizers, live in rebm/engine/optimizers.py and register themselves there; the
registry knows that module only by name and imports it on its first lookup, so rebm.config never
imports rebm.engine in code and the layers hold. Importing this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from rebm.config.frozen import Frozen
from rebm.registry import Registry


@dataclass
class OptimizerSection(Frozen):
    """The keys an optimizer step is built from (`cfg.optimization`; top-level keys of the
    file, `optimizer` is `name` here)."""

    name: str = "sgd"  # a name of rebm/engine/optimizers.py: sgd (momentum 0.9, nesterov), adam (betas 0, 0.99), adamw (0.9, 0.95)
    lr: float = 1e-3  # learning rate (stage 1: where its schedule starts)
    wd: float = 5e-4  # weight decay
    max_grad_norm: Optional[float] = None  # clip the gradients' total norm to this before each optimizer step, logged as grad_norm (null: no clipping)


OptimizerBuilder = Callable[[Iterable, OptimizerSection], Any]
OPTIMIZERS: Registry[OptimizerBuilder] = Registry("optimizer", "rebm.engine.optimizers")
