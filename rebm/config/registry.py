"""A registry of named choices (timm's pattern, as rebm.models.registry): a choice registers
itself by name, with its builder and what the config needs to know about it, where it is defined;
validation checks a config's value against the names, and the builder is looked up by name.

    OPTIMIZERS = Registry("optimizer", "rebm.config.optimizers")

    @OPTIMIZERS.register("sgd")
    def sgd(params, section): ...

The registries of datasets (rebm/data/sets) and optimizers (rebm/config/optimizers.py) are
instances. `package` is imported on the first lookup, with every public module in it, so a new
choice is one module (or one decorated function) and no list elsewhere names it.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from typing import Any, Callable, Dict, Generic, Tuple, TypeVar

from rebm.config.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> entry (a builder, or a record holding one) for the config key `key`."""

    def __init__(self, key: str, package: str):
        self.key = key  # the config key whose values are the names, e.g. data.indist_dataset
        self.package = package  # imported (with its public modules) before the first lookup
        self._entries: Dict[str, T] = {}
        self._loaded = False

    def add(self, name: str, entry: T) -> None:
        if name in self._entries and self._entries[name] != entry:
            raise ValueError(f"{self.key} '{name}' is registered twice")
        self._entries[name] = entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated object as `name`."""
        def add(entry: T) -> T:
            self.add(name, entry)
            return entry
        return add

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        module = importlib.import_module(self.package)
        for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
            if not info.name.startswith("_"):
                importlib.import_module(f"{self.package}.{info.name}")

    def names(self) -> Tuple[str, ...]:
        self._load()
        return tuple(self._entries)

    def __contains__(self, name: Any) -> bool:
        return name in self.names()

    def check(self, name: Any, source: str = "config") -> None:
        """ConfigError naming the key, the choices and the closest name, for an unknown `name`."""
        names = self.names()
        if name in names:
            return
        close = difflib.get_close_matches(str(name), names, n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"{source}: '{self.key}: {name}' is not a valid choice; use one of "
                          f"{', '.join(names)}{hint}")

    def get(self, name: str) -> T:
        """The entry of `name` (ConfigError for an unknown one)."""
        self.check(name)
        return self._entries[name]
