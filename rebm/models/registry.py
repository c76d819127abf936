"""The model registry: a model is registered once, by name, with its constructor.

    @register("WideResNet28x10")
    def wrn28_10(num_classes, **options): return WideResNet(28, num_classes, 10, **options)

Builders take `num_classes` and the keyword options every family takes (`normalize_input`,
`mean`, `std`, `use_batchnorm`, `in_channels`), plus the family's own `options`: the names of the
`model.*` config fields it reads (ConvNeXt: `use_convstem`, `use_layernorm`), declared at
registration. They return a `rebm.models.base.Classifier`.

Every public module of this package is imported the first time the registry is asked for a
model, so a family registers itself by being a file here: no list of modules to keep. Importing
them must stay cheap (torch, never timm): a family's expensive code lives in a private module
(`_timm_nets.py`) that its builders import when called. Importing this module imports no torch.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

from rebm.models.stats import dataset_stats


@dataclass(frozen=True)
class Registration:
    builder: Callable[..., Any]
    options: Tuple[str, ...]  # the family's own model.* fields, passed to the builder


_REGISTRY: Dict[str, Registration] = {}
PACKAGE = __name__.rpartition(".")[0]


def register(name: str, options: Tuple[str, ...] = ()
             ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: make `builder` the model `model.model_type: name`; `options` are the `model.*`
    config fields (beyond the common ones) that `model_from_config` passes to it."""
    def add(builder: Callable[..., Any]) -> Callable[..., Any]:
        if name in _REGISTRY and _REGISTRY[name].builder is not builder:
            raise ValueError(f"model '{name}' is registered twice")
        _REGISTRY[name] = Registration(builder, tuple(options))
        return builder
    return add


def _load_families() -> None:
    """Import every public module of the package (their import runs their registrations)."""
    for module in pkgutil.iter_modules([os.path.dirname(__file__)]):
        if not module.name.startswith("_"):
            importlib.import_module(f"{PACKAGE}.{module.name}")


def model_names() -> Tuple[str, ...]:
    """Every registered `model.model_type`."""
    _load_families()
    return tuple(_REGISTRY)


def _registration(model_type: str) -> Registration:
    _load_families()
    if model_type not in _REGISTRY:
        raise ValueError(f"unknown model_type '{model_type}'; use one of {', '.join(_REGISTRY)}")
    return _REGISTRY[model_type]


def build_model(model_type: str, num_classes: int, **options: Any):
    """The model registered as `model_type`, with `num_classes` outputs."""
    return _registration(model_type).builder(num_classes, **options)


def family_options(model_type: str) -> Tuple[str, ...]:
    """The `model.*` fields the family of `model_type` reads beyond the common ones."""
    return _registration(model_type).options


def all_family_options() -> Tuple[str, ...]:
    """The `model.*` fields some family reads (each once)."""
    _load_families()
    return tuple(dict.fromkeys(o for r in _REGISTRY.values() for o in r.options))


def model_from_config(cfg: Any):
    """The model a config describes (`model.*`, `data.num_classes`, the normalisation statistics
    of `data.indist_dataset`), randomly initialised on the CPU."""
    mean, std = dataset_stats(cfg.data.indist_dataset)
    model_type = cfg.model.model_type
    own = {name: getattr(cfg.model, name) for name in family_options(model_type)}
    return build_model(model_type, cfg.data.num_classes,
                       normalize_input=cfg.model.normalize_input, mean=mean, std=std,
                       use_batchnorm=cfg.model.use_batchnorm, **own)
