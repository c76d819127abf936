"""DDP / DataParallel / SyncBatchNorm / compile wrapping, and the ways back to the plain module.

Order in `wrap_model` matters: the model arrives on its device -> SyncBatchNorm ->
torch.compile -> DDP / DataParallel (DDP must see the final device placement, and wraps the
compiled module). Training attacks use `attack_view(model)` (compiled, never the DDP wrapper,
docs/design.md §1, but through DataParallel); EMA, evaluation and checkpoint saving use
`unwrap(model)`, the plain module.
"""

from __future__ import annotations

import contextlib
import logging
from typing import ContextManager

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from rebm.distributed.runtime import Runtime
from rebm.distributed.torch_versions import distributed_data_parallel

LOGGER = logging.getLogger("rebm")


def resolve_channels_last(setting, device: torch.device, amp: str) -> bool:
    """`model.channels_last` (true, false or auto) -> whether to use it on this run; the one
    place `auto` is decided (docs/performance.md has the measurements).

    auto is on where channels_last was measured to help: on CPU (oneDNN convolutions run
    natively in NHWC: 0.8x step time on WideResNet) and on CUDA under bf16/fp16 autocast
    (tensor-core convolutions want NHWC). It stays off on CUDA in fp32 and on other
    accelerators, where it is not known to help (not measured here)."""
    if setting != "auto":
        return bool(setting)
    if device.type == "cpu":
        return True
    return device.type == "cuda" and amp in ("bf16", "fp16")


def strip_parallel(model: nn.Module) -> nn.Module:
    """The module without its DDP / DataParallel wrappers, still compiled when it was.

    The attacks run on this: never through DDP (a grad-enabled DDP forward arms a collective
    that a rank-local attack would leave waiting), but through torch.compile, since the T + K
    attack passes are nearly all of a step's work."""
    while isinstance(model, (DDP, nn.DataParallel)):
        model = model.module
    return model


def attack_view(model: nn.Module) -> nn.Module:
    """What the attacks of a training step run on: the model without DDP, but still through
    DataParallel when the one-process fallback (use_ddp=false) uses it. DataParallel has no
    collectives, and scattering the T + K attack passes over the GPUs is where that fallback's
    speed comes from (the original code ran its attacks through it too); compiled if it is."""
    while isinstance(model, DDP):
        model = model.module
    return model


def scoring_view(model: nn.Module) -> nn.Module:
    """What a step's no-grad scoring forwards run on (the AUC scores of log steps): the attack
    view, but uncompiled. A compiled module would compile one more graph for them (no input
    requires grad), a recompilation on the first log step for forwards that run rarely."""
    view = attack_view(model)
    plain = unwrap(view)
    # compiled (under DataParallel too): the plain module, on one device; else the view itself
    return plain if plain is not strip_parallel(view) else view


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under any nesting of DDP, DataParallel and torch.compile wrappers."""
    while True:
        model = strip_parallel(model)
        if not isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile
            return model
        model = model._orig_mod


def wrap_model(model: nn.Module, runtime: Runtime, *, live_batchnorm: bool,
               sync_batchnorm: bool = False, compile: bool = False,
               find_unused_parameters: bool = False) -> tuple:
    """(model for the training forward/backward, plain module sharing its parameters).

    `model` is already on runtime.device. SyncBatchNorm only where it can work (several ranks on
    an accelerator, live BatchNorm); DDP under a process group, DataParallel for one process
    over several GPUs (use_ddp=false)."""
    if sync_batchnorm:
        if not live_batchnorm:
            LOGGER.info("sync_batchnorm ignored: BatchNorm is frozen (model.use_batchnorm=false)")
        elif not runtime.distributed:
            pass  # one process: nothing to synchronise
        elif runtime.device.type == "cpu":
            # SyncBatchNorm has no CPU kernel; statistics stay per rank on CPU runs. A note, not
            # a warning: a config written for GPUs (the quickstart's) runs on CPU as intended.
            LOGGER.info("sync_batchnorm ignored on CPU (SyncBatchNorm needs an accelerator)")
        else:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    raw = model
    if compile:
        model = torch.compile(model)
    if runtime.distributed:
        model = distributed_data_parallel(
            model,
            device_ids=[runtime.local_rank] if runtime.device.type == "cuda" else None,
            # Frozen BN: running stats never change, so broadcasting them every forward is waste.
            forward_sync_buffers=live_batchnorm,
            find_unused_parameters=find_unused_parameters,
        )
    elif runtime.data_parallel:
        model = nn.DataParallel(model)
    return model, raw


def has_sync_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())


def micro_step_sync(model: nn.Module, last: bool) -> ContextManager:
    """Gradient accumulation: DDP all-reduces gradients only on the last micro-batch of an
    optimizer step (`no_sync()` before it); plain modules need nothing."""
    no_sync = getattr(model, "no_sync", None)
    return contextlib.nullcontext() if last or no_sync is None else no_sync()
