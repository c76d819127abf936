"""The model registry: a model is registered once, by name, with its constructor.

    @register("WideResNet28x10")
    def wrn28_10(num_classes, **options): return WideResNet(28, num_classes, 10, **options)

Builders take `num_classes` and the keyword options `normalize_input`, `mean`, `std`,
`use_batchnorm`, `in_channels` (ConvNeXts also `use_convstem`, `use_layernorm`), and return a module whose forward(x, y=None) gives logits (or the
logits of classes y). This module imports no torch: the built-in models are imported on first use,
so `import rebm.models` stays cheap.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Dict, Tuple

# Modules whose import registers the built-in models.
BUILTIN_MODULES = ("rebm.models.wideresnet", "rebm.models.imagenet")

_BUILDERS: Dict[str, Callable[..., Any]] = {}


def register(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: make `builder` the model `model.model_type: name`."""
    def add(builder: Callable[..., Any]) -> Callable[..., Any]:
        if name in _BUILDERS and _BUILDERS[name] is not builder:
            raise ValueError(f"model '{name}' is registered twice")
        _BUILDERS[name] = builder
        return builder
    return add


def _load_builtins() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)


def model_names() -> Tuple[str, ...]:
    """Every registered `model.model_type`, in registration order."""
    _load_builtins()
    return tuple(_BUILDERS)


def build_model(model_type: str, num_classes: int, **options: Any):
    """The model registered as `model_type`, with `num_classes` outputs."""
    _load_builtins()
    if model_type not in _BUILDERS:
        raise ValueError(f"unknown model_type '{model_type}'; use one of {', '.join(_BUILDERS)}")
    return _BUILDERS[model_type](num_classes, **options)


def accepts(model_type: str, option: str) -> bool:
    """Whether the builder of `model_type` takes the keyword option `option`."""
    _load_builtins()
    return option in inspect.signature(_BUILDERS[model_type]).parameters


# Options of model.* that only some families take (ConvNeXt); passed to the builders that do.
FAMILY_OPTIONS = ("use_convstem", "use_layernorm")


def model_from_config(cfg: Any):
    """The model a config describes (`model.*`, `data.num_classes`, the normalisation statistics
    of `data.indist_dataset`), randomly initialised on the CPU."""
    from rebm.models.wideresnet import dataset_stats

    _load_builtins()
    mean, std = dataset_stats(cfg.data.indist_dataset)
    model_type = cfg.model.model_type
    family = {name: getattr(cfg.model, name) for name in FAMILY_OPTIONS
              if model_type in _BUILDERS and accepts(model_type, name)}
    return build_model(model_type, cfg.data.num_classes,
                       normalize_input=cfg.model.normalize_input, mean=mean, std=std,
                       use_batchnorm=cfg.model.use_batchnorm, **family)
