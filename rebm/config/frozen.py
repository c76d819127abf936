"""A loaded config is frozen (docs/design.md §2): nothing changes the experiment at run time.

It also remembers which keys the YAML file and the command line set (`explicit_keys`): the
legacy-field notice and the run identity read them, through the accessors below.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any, Optional, Sequence, Tuple, TypeVar

T = TypeVar("T")


class Frozen:
    """Config sections refuse assignment once `freeze` ran (after loading and validation), so
    nothing changes the experiment at run time; unfrozen instances (tests) behave normally."""

    _frozen = False
    _explicit_keys: Tuple[str, ...] = ()  # read through explicit_keys(cfg)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in getattr(self, "__dataclass_fields__", {name: None}):  # a key of no section
            raise AttributeError(f"{type(self).__name__} has no config key '{name}' "
                                 "(rebm/config/layout.py says which section holds each key)")
        if self._frozen:
            raise AttributeError(f"the config is frozen after loading; cannot set '{name}' "
                                 "(use rebm.config.replace for a changed copy)")
        object.__setattr__(self, name, value)


def freeze(section: T, explicit: Optional[Sequence[str]] = None) -> T:
    """Freeze a config section (the whole config too) and the sections in it, in place; returns
    it. `explicit`: the dotted keys the file and the command line set."""
    if explicit is not None:
        object.__setattr__(section, "_explicit_keys", tuple(sorted(set(explicit))))
    for f in fields(section):  # type: ignore[arg-type]
        value = getattr(section, f.name)
        if is_dataclass(value):
            freeze(value)
    object.__setattr__(section, "_frozen", True)
    return section


def explicit_keys(cfg: Any) -> Tuple[str, ...]:
    """The dotted keys (`lr`, `attack.max_steps`, and each section name) that the config file or
    the command line set, as written there after the aliases of rebm.config.aliases; a config
    built in code has none."""
    return cfg._explicit_keys
