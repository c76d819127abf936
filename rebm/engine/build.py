"""Build the model of a training run from its sections (the optimizer: rebm/engine/optimizers.py).

Order matters: build -> load `model.ckpt_path` (names carry no wrapper prefixes yet) ->
channels_last -> .to(device) -> SyncBatchNorm / compile / DDP or DataParallel
(rebm.distributed.parallel.wrap_model).
"""

from __future__ import annotations

import logging
from typing import Optional, Tuple

import torch
import torch.nn as nn

from rebm.checkpoint.run_directory import RunDirectory
from rebm.checkpoint.weights import load_checkpoint
from rebm.config.schema import DataConfig, ModelConfig
from rebm.config.views import NetworkSection
from rebm.distributed.collectives import on_every_rank
from rebm.distributed.compile_cache import CompileCache, cache_key, open_cache
from rebm.distributed.parallel import resolve_channels_last, wrap_model
from rebm.distributed.runtime import Runtime
from rebm.engine.compiling import CompileChoice, decide_compile
from rebm.models import model_from_config

LOGGER = logging.getLogger("rebm")


def compile_choice(model: ModelConfig, runtime: Runtime, planned_steps: float) -> CompileChoice:
    """Whether a run of `planned_steps` optimizer steps compiles (model.compile, auto included)."""
    return decide_compile(model.compile, runtime.device, planned_steps)


def build_model_all_ranks(network: NetworkSection, runtime: Runtime,
                          load_pretrained: bool = True, planned_steps: float = 0
                          ) -> Tuple[nn.Module, nn.Module]:
    """(wrapped model for the training forward/backward, raw module sharing its parameters).

    load_pretrained=False skips `model.ckpt_path` (a resumed run loads its weights from the
    training state instead). `planned_steps`: the training run's length, which decides
    `model.compile: auto` (0: built for anything but training, so auto does not compile).
    `raw` is the uncompiled, unwrapped module: use it for evaluation, EMA and saving; attacks
    take `attack_view(model)`, which keeps the compilation.
    """
    model_section, distributed = network.model, network.distributed
    model = model_from_config(model_section, network.data)
    if model_section.ckpt_path and load_pretrained:
        # Every rank reads the file itself (no broadcast of weights); a rank that cannot (the
        # file is missing on its node) stops every rank here, before DDP's first collective.
        on_every_rank(runtime, lambda: load_checkpoint(model, model_section.ckpt_path,
                                                       trust=model_section.trust_checkpoint),
                      f"read model.ckpt_path '{model_section.ckpt_path}'")
    channels_last = resolve_channels_last(model_section.channels_last, runtime.device, distributed.amp)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = model.to(runtime.device)
    compiling = compile_choice(model_section, runtime, planned_steps)
    LOGGER.info("speed options: channels_last %s (model.channels_last=%s) | amp %s | compile %s",
                "on" if channels_last else "off", model_section.channels_last, distributed.amp,
                compiling.describe())
    return wrap_model(model, runtime, live_batchnorm=model_section.use_batchnorm,
                      sync_batchnorm=distributed.sync_batchnorm, compile=compiling.enabled,
                      find_unused_parameters=distributed.find_unused_parameters)


def get_compile_cache(network: NetworkSection, run_dir: Optional[str], runtime: Runtime,
                      planned_steps: float) -> Optional[CompileCache]:
    """When the run compiles and has a run_dir, its compile cache, loaded before the first
    compile (which happens at the first forward); the training run owns it."""
    model, amp = network.model, network.distributed.amp
    if not compile_choice(model, runtime, planned_steps).enabled:
        return None
    channels_last = resolve_channels_last(model.channels_last, runtime.device, amp)
    key = cache_key(runtime.device, _shaping(model, network.data, amp, channels_last))
    path = RunDirectory(run_dir).compile_cache(key) if run_dir else None
    cache, phrase = open_cache(path, writer=runtime.is_main)
    LOGGER.info("torch.compile: %s", phrase)
    return cache


def _shaping(model: ModelConfig, data: DataConfig, amp: str, channels_last: bool) -> dict:
    """The config values the compiled code depends on (the compile cache's key)."""
    return {"model": model.model_type, "classes": data.num_classes,
            "image_size": data.image_size, "normalize": model.normalize_input,
            "batchnorm": model.use_batchnorm, "amp": amp, "channels_last": channels_last}
