"""Where the keys of a loaded config were set, so that an error about a value names the place
to fix it: the command line for a key its overrides set (they win over the file), else the
config file. The loader's own checks blame the command line when the file alone is valid; the
methods' rules (rebm.methods) check keys one at a time and ask this for each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from omegaconf import OmegaConf

from rebm.config.aliases import apply_aliases

COMMAND_LINE = "command line"


@dataclass(frozen=True)
class ConfigOrigins:
    """`file`: the YAML file (None: none was given); `command_line`: the dotted keys, in the
    file's layout after the aliases, that the overrides set."""

    file: Optional[str] = None
    command_line: Tuple[str, ...] = ()

    def of(self, *keys: str) -> str:
        """Where the values of `keys` came from: the command line when its overrides set any of
        them, else the config file ("config" for a config built without one)."""
        if any(key in self.command_line for key in keys):
            return COMMAND_LINE
        return self.file or "config"


# A config built in code (a method constructed directly): its errors name "config"
BUILT_IN_CODE = ConfigOrigins()


def config_origins(path: Optional[str], overrides: Sequence[str]) -> ConfigOrigins:
    """The origins of `load_config(path, overrides)`'s keys (call it once that config loaded:
    the overrides parse)."""
    raw = OmegaConf.from_dotlist(list(overrides))
    apply_aliases(raw, COMMAND_LINE)
    return ConfigOrigins(path, tuple(_dotted_keys(OmegaConf.to_container(raw))))


def _dotted_keys(container: Any, prefix: str = "") -> List[str]:
    keys: List[str] = []
    if isinstance(container, dict):
        for key, value in container.items():
            keys.append(f"{prefix}{key}")
            keys.extend(_dotted_keys(value, f"{prefix}{key}."))
    return keys

