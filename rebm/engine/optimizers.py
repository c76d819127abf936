"""rebm's optimizers, those of the original DAT code (its rebm/training/modeling.py:
get_optimizer): the hyper-parameters beyond lr and weight decay are fixed, as there.

Each registers itself by name in `rebm.config.optimizers.OPTIMIZERS`, the registry that config
validation checks `optimizer` against (it imports this module on its first lookup). Adding an
optimizer is one decorated function here (docs/design.md, extension costs):

    @OPTIMIZERS.register("lion")
    def lion(params, section: OptimizerSection): return Lion(params, lr=section.lr, ...)
"""

from __future__ import annotations

from typing import Iterable

import torch

from rebm.config.optimizers import OPTIMIZERS, OptimizerSection


@OPTIMIZERS.register("sgd")
def sgd(params: Iterable, section: OptimizerSection) -> torch.optim.Optimizer:
    """SGD, momentum 0.9, Nesterov."""
    return torch.optim.SGD(params, lr=section.lr, momentum=0.9, nesterov=True,
                           weight_decay=section.wd)


@OPTIMIZERS.register("adam")
def adam(params: Iterable, section: OptimizerSection) -> torch.optim.Optimizer:
    """Adam, betas (0, 0.99)."""
    return torch.optim.Adam(params, lr=section.lr, betas=(0.0, 0.99), weight_decay=section.wd)


@OPTIMIZERS.register("adamw")
def adamw(params: Iterable, section: OptimizerSection) -> torch.optim.Optimizer:
    """AdamW, betas (0.9, 0.95)."""
    return torch.optim.AdamW(params, lr=section.lr, betas=(0.9, 0.95), weight_decay=section.wd)


def build_optimizer(section: OptimizerSection, params: Iterable) -> torch.optim.Optimizer:
    """The optimizer `section.name` over `params` (ConfigError for an unknown name)."""
    return OPTIMIZERS.get(section.name)(params, section)
