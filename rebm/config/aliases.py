"""Renaming the original configs' spellings of rebm's fields (declared in
rebm/compat/aliases.py) on the raw mapping of each source (the YAML file, then the command line)
before it is merged onto the dataclasses, so the loaded config holds only rebm's fields and
validation only checks. A source that sets both spellings to different values is a one-line error.
configs.md lists the aliases (rebm/config/docs.py reads `ALIASES`).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from omegaconf import DictConfig

from rebm.compat.aliases import ALIASES
from rebm.config.errors import ConfigError

__all__ = ["ALIASES", "apply_aliases", "canonical_key"]


def canonical_key(key: str) -> str:
    """rebm's name of a dotted key (itself unless it is an alias)."""
    return next((a.new for a in ALIASES if a.old == key), key)


def _parent(raw: DictConfig, dotted: str, create: bool) -> Tuple[Optional[DictConfig], str]:
    *path, leaf = dotted.split(".")
    node: Any = raw
    for name in path:
        if name not in node and create:
            node[name] = {}
        node = node.get(name) if isinstance(node, DictConfig) else None
        if not isinstance(node, DictConfig):
            return None, leaf
    return node, leaf


def apply_aliases(raw: DictConfig, source: str) -> None:
    """Rename the aliases of one source's raw mapping in place."""
    for alias in ALIASES:
        parent, leaf = _parent(raw, alias.old, create=False)
        if parent is None or leaf not in parent:
            continue
        value = parent.pop(leaf)
        new_value = alias.convert(value)
        if new_value is None:
            continue
        target, new_leaf = _parent(raw, alias.new, create=True)
        if target is None:  # a section written as something else: the merge reports it
            continue
        existing = target.get(new_leaf)
        if existing is not None and existing != new_value:
            raise ConfigError(f"{source}: '{alias.old}: {value}' and '{alias.new}: {existing}' "
                        f"disagree ('{alias.old}' is the original's name of '{alias.new}'); "
                        f"set only '{alias.new}'")
        target[new_leaf] = new_value
