"""The names DAT scripts import: `from rebm.training.modeling import get_model, get_optimizer,
load_checkpoint`, at the original's import path.

Serves: scripts written against the original DAT code (xuwangyin/DAT rebm/training/modeling.py).
It belongs to the compatibility boundary (rebm/compat/__init__.py) but lives here, in the top
layer, because it calls the checkpoint loader, the models, the wrappers and the optimizers, which
sit above rebm/compat (whose modules are declarations that rebm.config and rebm.checkpoint read).
The original's call forms (rebm/training/modeling.py of xuwangyin/DAT) work unchanged:

    model = get_model(model_config=cfg.model, device=device, num_classes=cfg.data.num_classes,
                      indist_dataset=cfg.data.indist_dataset, use_ddp=False, rank=0)
    model = load_checkpoint(model, ckpt_path)            # returns the model it loaded into
    optimizer = get_optimizer(model=model, optimizer_name="adam", lr=1e-3, wd=5e-4)

These are the original's signatures only, for scripts written against it; rebm's own code
builds models through the registry (`rebm.models.model_from_config`) and the engine
(`rebm.engine.build.build_model_all_ranks(cfg.network, runtime) ->
(wrapped, raw)`, `rebm.engine.optimizers.build_optimizer(cfg.optimization, params)`).
"""

from __future__ import annotations

from typing import Any, Union

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from rebm.checkpoint.weights import load_checkpoint as load_weights
from rebm.config.optimizers import OptimizerSection
from rebm.distributed.parallel import strip_parallel, unwrap
from rebm.engine.optimizers import build_optimizer
from rebm.models import build_model, dataset_stats, family_options

__all__ = ["get_model", "get_optimizer", "load_checkpoint", "strip_parallel", "unwrap"]


def load_checkpoint(model: nn.Module, ckpt_path: str, weights_only: bool = True, *,
                    strict: bool = True, prefer_ema: bool = False) -> nn.Module:
    """DAT's `load_checkpoint(model, ckpt_path, weights_only=True) -> model`, on rebm's universal
    loader: every layout of docs/design.md §5 (`module.` from DataParallel/DDP, the original EMA
    layout, containers, ...) into a plain or wrapped model; returns `model`.

    weights_only: True (the original's default) reads tensors, containers and rebm's allow-list
    only (rebm.checkpoint.weights.read_checkpoint); False says the caller trusts the file, whose
    other Python objects are then unpickled too. `strict` / `prefer_ema`: as
    rebm.checkpoint.weights.load_checkpoint (whose LoadReport this form does not return).
    """
    load_weights(model, ckpt_path, strict=strict, prefer_ema=prefer_ema, trust=not weights_only)
    return model


def get_model(model_config: Any, device: Union[str, torch.device], num_classes: int,
              indist_dataset: str, use_ddp: bool = False, rank: int = 0) -> nn.Module:
    """The original's get_model: build `model_config.model_type` (any registered model), move it
    to `device`, wrap it (DDP with use_ddp, else nn.DataParallel, as the original does even on one
    device), then load `model_config.ckpt_path` when set. Normalisation statistics come from
    `indist_dataset` (CIFAR-10's for CIFAR, as in the original)."""
    mean, std = dataset_stats(indist_dataset)
    device = torch.device(device)
    model_type = model_config.model_type
    own = {name: getattr(model_config, name) for name in family_options(model_type)
           if hasattr(model_config, name)}
    model = build_model(model_type, num_classes,
                        normalize_input=getattr(model_config, "normalize_input", True),
                        mean=mean, std=std,
                        use_batchnorm=getattr(model_config, "use_batchnorm", False), **own)
    model = model.to(device)
    if use_ddp:
        # The original passes device_ids=[rank]; the device the model sits on is the same GPU
        # on one node and the right one on several.
        index = rank if device.index is None else device.index
        model = DDP(model, device_ids=[index] if device.type == "cuda" else None)
    else:
        model = nn.DataParallel(model)
    ckpt_path = getattr(model_config, "ckpt_path", None)
    if ckpt_path is not None:
        model = load_checkpoint(model, ckpt_path)
    return model


def get_optimizer(model: nn.Module, optimizer_name: str, lr: float, wd: float
                  ) -> torch.optim.Optimizer:
    """The original's get_optimizer: over `model.parameters()`, with rebm's optimizers (SGD
    momentum 0.9 Nesterov, Adam betas (0, 0.99), AdamW (0.9, 0.95); the same as the original)."""
    section = OptimizerSection(name=optimizer_name, lr=lr, wd=wd)
    return build_optimizer(section, model.parameters())
