"""The one registry of named choices (timm's pattern): models, datasets, optimizers and metrics.

A choice registers itself by name, with its builder or a record holding one, in the module that
implements it; validation checks a value against the names, and the entry is looked up by name:

    OPTIMIZERS = Registry("optimizer", package="rebm.engine.optimizers")

    @OPTIMIZERS.register("sgd")
    def sgd(params, section): ...

- `package`: imported, with every public module in it, on the first lookup, so a new choice is
  one module (or one decorated function) and no list elsewhere names it; the registry knows the
  package only by name, so a lower layer can hold the registry of a higher one's choices. None:
  the entries are added explicitly (the metrics, whose order is a list).
- names keep the order of registration (the metrics run and are reported in it);
- an unknown name is one line naming the config key, the choices and the closest name;
- names are matched exactly, case included, as the original DAT code matched them (its
  `get_optimizer`'s `match`, `norm == "L2"`): a name that differs only in case is refused, and
  the line names the spelling to use (`choice_message`, also for the config's fixed choices).

It sits in the bottom layer (pyproject.toml) and imports only rebm.errors.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from typing import Any, Callable, Dict, Generic, Iterable, Optional, Tuple, Type, TypeVar

from rebm.errors import ConfigError

T = TypeVar("T")


def choice_message(key: str, value: Any, choices: Iterable[str], source: str,
                   cutoff: float = 0.5) -> str:
    """The one line of a `value` of `key` that is none of `choices`: the choices, and the one
    it differs from only in case, or else the closest one."""
    names = list(choices)
    same_letters = [n for n in names if n.lower() == str(value).lower()]
    if same_letters:
        hint = f"; names are case-sensitive: use '{same_letters[0]}'"
    else:
        close = difflib.get_close_matches(str(value), names, n=1, cutoff=cutoff)
        hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"{source}: '{key}: {value}' is not a valid choice; use one of {', '.join(names)}{hint}"


class Registry(Generic[T]):
    """Name -> entry (a builder, or a record holding one) for the config key `key`."""

    def __init__(self, key: str, package: Optional[str] = None, *,
                 error: Type[Exception] = ConfigError, cutoff: float = 0.5):
        self.key = key  # the config key whose values are the names, e.g. data.indist_dataset
        self.package = package  # imported (with its public modules) before the first lookup
        self.error = error  # raised for an unknown name
        self.cutoff = cutoff  # how close a name must be to be suggested (difflib's ratio)
        self._entries: Dict[str, T] = {}
        self._loaded = package is None

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
        """Every registered name, in the order of registration."""
        self._load()
        return tuple(self._entries)

    def items(self) -> Tuple[Tuple[str, T], ...]:
        self._load()
        return tuple(self._entries.items())

    def __contains__(self, name: Any) -> bool:
        return name in self.names()

    def closest(self, name: Any, choices: Optional[Iterable[str]] = None) -> Optional[str]:
        """The name (of `choices`, by default the registered ones) closest to a mistyped one."""
        names = list(self.names() if choices is None else choices)
        close = difflib.get_close_matches(str(name), names, n=1, cutoff=self.cutoff)
        return close[0] if close else None

    def unknown_message(self, name: Any, source: str) -> str:
        """The one line of an unknown `name`; a registry with another wording overrides it."""
        return choice_message(self.key, name, self.names(), source, self.cutoff)

    def check(self, name: Any, source: str = "config") -> None:
        """`error` (one line: the key, the choices and the closest name) for an unknown `name`."""
        if name not in self.names():
            raise self.error(self.unknown_message(name, source))

    def get(self, name: str) -> T:
        """The entry of `name` (`error` for an unknown one)."""
        self.check(name)
        return self._entries[name]
