"""Legacy fields of the original DAT configs (declared in rebm/compat/config_fields.py): which
keys they are, the refusal of the values whose effect rebm does not offer, and the start-up
notice naming those a config sets. Fields the original read under another name of rebm's are
aliases (rebm/compat/aliases.py), not here.
"""

from __future__ import annotations

from dataclasses import Field, fields
from typing import Any, List, Optional, Set

from rebm.compat.config_fields import LEGACY_BASES
from rebm.config.errors import ConfigError
from rebm.config.frozen import explicit_keys
from rebm.config.layout import file_leaves


def legacy_fields(cls: type) -> List[Field]:
    """The fields `cls` inherits from a legacy base."""
    return [f for base in cls.__mro__ if base in LEGACY_BASES for f in fields(base)]


def legacy_names(cls: type) -> Set[str]:
    return {f.name for f in legacy_fields(cls)}


def legacy_keys(cfg_cls: type) -> Set[str]:
    """The file's dotted keys of every legacy field of a config class and its sections."""
    return {key for key, _, owner, f in file_leaves(cfg_cls())
            if f.name in legacy_names(type(owner))}


def check_refused(cfg: Any, source: str) -> None:
    """ConfigError for a refused field of the config set to a value whose effect rebm does not
    offer, named by its key in the file."""
    for key, _, owner, f in file_leaves(cfg):
        accepted = f.metadata.get("accepted") if f.name in legacy_names(type(owner)) else None
        value = getattr(owner, f.name)
        if accepted is not None and value not in accepted:
            allowed = " or ".join("null" if a is None else repr(a) for a in accepted)
            raise ConfigError(
                f"{source}: '{key}: {value}' is not supported (in the original DAT "
                f"code: "
                f"{f.metadata['why']}); remove the key or set it to {allowed}")


def ignored_fields_set(cfg: Any) -> List[str]:
    """Legacy fields the config file or the command line set (reported once at start-up)."""
    legacy = legacy_keys(type(cfg))
    return [key for key in explicit_keys(cfg) if key in legacy]


def ignored_fields_notice(cfg: Any) -> Optional[str]:
    """One line naming the legacy fields the config sets (None when it sets none)."""
    keys = ignored_fields_set(cfg)
    if not keys:
        return None
    return (f"config fields accepted for compatibility, without effect (docs/configs.md says "
            f"why): {', '.join(keys)}")
