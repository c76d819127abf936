"""Build, load and wrap the model; the one place that knows about DDP / DataParallel / compile.

Order in `get_model` matters:
  build -> load `model.ckpt_path` (names carry no wrapper prefixes yet) -> channels_last ->
  .to(device) -> SyncBatchNorm -> torch.compile -> DDP / DataParallel (DDP must see the final
  device placement, and wraps the compiled module).
Attacks use `strip_parallel(model)` (compiled, never the DDP wrapper, DESIGN.md §1); EMA,
evaluation and checkpoint saving use `unwrap(model)`, the plain module.
"""

from __future__ import annotations

import logging
from typing import Iterable, Tuple

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

LOGGER = logging.getLogger("rebm")


def strip_parallel(model: nn.Module) -> nn.Module:
    """The module without its DDP / DataParallel wrappers, still compiled when it was.

    The attacks run on this: never through DDP (a grad-enabled DDP forward arms a collective
    that a rank-local attack would leave waiting), but through torch.compile, since the T + K
    attack passes are nearly all of a step's work."""
    while isinstance(model, (DDP, nn.DataParallel)):
        model = model.module
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under any nesting of DDP, DataParallel and torch.compile wrappers."""
    while True:
        model = strip_parallel(model)
        if not isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile
            return model
        model = model._orig_mod


def get_model(cfg, runtime, load_pretrained: bool = True) -> Tuple[nn.Module, nn.Module]:
    """(wrapped model for the training forward/backward, raw module sharing its parameters).

    load_pretrained=False skips `model.ckpt_path` (a resumed run loads its weights from the
    training state instead).

    `raw` is the uncompiled, unwrapped module: use it for evaluation, EMA and saving; attacks
    take `strip_parallel(model)`, which keeps the compilation.
    """
    from rebm.models import build_model, dataset_stats
    from rebm.training.checkpoint_io import load_checkpoint

    mean, std = dataset_stats(cfg.data.indist_dataset)
    model = build_model(
        cfg.model.model_type,
        cfg.data.num_classes,
        normalize_input=cfg.model.normalize_input,
        mean=mean,
        std=std,
        use_batchnorm=cfg.model.use_batchnorm,
    )
    if cfg.model.ckpt_path and load_pretrained:
        # Every rank reads the file itself: no broadcast needed, and no rank-0-only branch.
        load_checkpoint(model, cfg.model.ckpt_path)
    if cfg.model.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = model.to(runtime.device)

    if cfg.sync_batchnorm:
        if not cfg.model.use_batchnorm:
            LOGGER.info("sync_batchnorm ignored: BatchNorm is frozen (model.use_batchnorm=false)")
        elif not runtime.distributed:
            pass  # one process: nothing to synchronise
        elif runtime.device.type == "cpu":
            # SyncBatchNorm has no CPU kernel; statistics stay per rank on CPU runs.
            LOGGER.warning("sync_batchnorm ignored on CPU (SyncBatchNorm needs an accelerator)")
        else:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    raw = model

    if cfg.model.compile:
        model = torch.compile(model)
    if runtime.distributed:
        model = DDP(
            model,
            device_ids=[runtime.local_rank] if runtime.device.type == "cuda" else None,
            # Frozen BN: running stats never change, so broadcasting them every forward is waste.
            forward_sync_buffers=cfg.model.use_batchnorm,
            find_unused_parameters=cfg.find_unused_parameters,
        )
    elif runtime.data_parallel:
        model = nn.DataParallel(model)
    return model, raw


def get_optimizer(cfg, params: Iterable) -> torch.optim.Optimizer:
    name = cfg.optimizer.lower()
    if name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, nesterov=True, weight_decay=cfg.wd)
    if name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=(0.0, 0.99), weight_decay=cfg.wd)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.wd)
    raise ValueError(f"unknown optimizer '{cfg.optimizer}'; use one of sgd, adam, adamw")
