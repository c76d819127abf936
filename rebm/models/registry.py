"""The model registry: a model is registered once, by name, with its constructor.

    @register("WideResNet28x10")
    def wrn28_10(num_classes, **options): return WideResNet(28, num_classes, 10, **options)

Builders take `num_classes` and the keyword options every family takes (`normalize_input`,
`mean`, `std`, `use_batchnorm`, `in_channels`), plus the family's own `options`: the names of the
`model.*` config fields it reads (ConvNeXt: `use_convstem`, `use_layernorm`), declared at
registration. They return a `rebm.models.base.Classifier`.

`MODELS` is a rebm.registry.Registry over this package: every public module of it is imported the
first time the registry is asked for a model, so a family registers itself by being a file here:
no list of modules to keep. Importing them must stay cheap (torch, never timm): a family's
expensive code lives in a private module (`_timm_nets.py`) that its builders import when called.
Importing this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Tuple

from rebm.models.stats import dataset_stats
from rebm.registry import Registry


@dataclass(frozen=True)
class ModelEntry:
    builder: Callable[..., Any]
    options: Tuple[str, ...]  # the family's own model.* fields, passed to the builder


MODELS: Registry[ModelEntry] = Registry("model.model_type", __name__.rpartition(".")[0])


def register(name: str, options: Tuple[str, ...] = ()
             ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: make `builder` the model `model.model_type: name`; `options` are the `model.*`
    config fields (beyond the common ones) that `model_from_config` passes to it."""
    def add(builder: Callable[..., Any]) -> Callable[..., Any]:
        MODELS.add(name, ModelEntry(builder, tuple(options)))
        return builder
    return add


def model_names() -> Tuple[str, ...]:
    """Every registered `model.model_type`."""
    return MODELS.names()


def build_model(model_type: str, num_classes: int, **options: Any):
    """The model registered as `model_type`, with `num_classes` outputs."""
    return MODELS.get(model_type).builder(num_classes, **options)


def family_options(model_type: str) -> Tuple[str, ...]:
    """The `model.*` fields the family of `model_type` reads beyond the common ones."""
    return MODELS.get(model_type).options


def all_family_options() -> Tuple[str, ...]:
    """The `model.*` fields some family reads (each once)."""
    return tuple(dict.fromkeys(o for _, entry in MODELS.items() for o in entry.options))


def model_from_config(cfg: Any):
    """The model a config describes (`model_from_sections` of its `model` and `data`)."""
    return model_from_sections(cfg.model, cfg.data)


def model_from_sections(model: Any, data: Any):
    """The model the sections describe (`model.*`, `data.num_classes`, the normalisation
    statistics of `data.indist_dataset`), randomly initialised on the CPU."""
    mean, std = dataset_stats(data.indist_dataset)
    model_type = model.model_type
    own = {name: getattr(model, name) for name in family_options(model_type)}
    return build_model(model_type, data.num_classes,
                       normalize_input=model.normalize_input, mean=mean, std=std,
                       use_batchnorm=model.use_batchnorm, **own)
