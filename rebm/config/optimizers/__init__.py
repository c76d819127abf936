"""The optimizer section and its registry: `optimizer`, `lr`, `wd` of the config, read by one
builder (`build_optimizer`); the optimizers are registered by name in the modules of this package.

Adding an optimizer is one module here (docs/design.md, extension costs):

    @OPTIMIZERS.register("lion")
    def lion(params, section: OptimizerSection): return Lion(params, lr=section.lr, ...)

and `optimizer: lion` in a config; validation names the registered choices. Importing this
package imports no torch (the builders' modules do, when the registry is first asked).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from rebm.registry import Registry


@dataclass(frozen=True)
class OptimizerSection:
    """The config keys an optimizer is built from (top-level keys of the original schema)."""

    name: str  # `optimizer`, lower-cased (the original accepts SGD as sgd)
    lr: float  # `lr`
    wd: float  # `wd`


OptimizerBuilder = Callable[[Iterable, OptimizerSection], Any]
OPTIMIZERS: Registry[OptimizerBuilder] = Registry("optimizer", __name__)


def optimizer_section(cfg: Any) -> OptimizerSection:
    return OptimizerSection(name=str(cfg.optimizer).lower(), lr=cfg.lr, wd=cfg.wd)


def build_optimizer(section: OptimizerSection, params: Iterable):
    """The optimizer `section.name` over `params` (ConfigError for an unknown name)."""
    return OPTIMIZERS.get(section.name)(params, section)
