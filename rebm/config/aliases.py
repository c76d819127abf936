"""Spellings of the original configs that name a field of rebm's under another key.

They are renamed on the raw mapping of each source (the YAML file, then the command line) before
it is merged onto the dataclasses, so the loaded config holds only rebm's fields and validation
only checks. A source that sets both spellings to different values is a one-line error.
configs.md lists the aliases (rebm/config/docs.py reads `ALIASES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from omegaconf import DictConfig

from rebm.config.errors import ConfigError


def _same(value: Any) -> Any:
    return value


def _fp16_to_amp(value: Any) -> Optional[str]:
    return "fp16" if value is True else None


@dataclass(frozen=True)
class Alias:
    old: str  # the dotted key as the original configs write it
    new: str  # rebm's field
    meaning: str  # for configs.md
    convert: Callable[[Any], Any] = _same  # old value -> new value (None: it says nothing)


ALIASES: Tuple[Alias, ...] = (
    Alias("fp16", "amp", "the original's switch: `fp16: true` is `amp: fp16`; `fp16: false` "
          "sets nothing (the original's newest training code defines it but reads it nowhere)",
          _fp16_to_amp),
    Alias("resume_path", "resume_from_state", "the original's spelling"),
    Alias("image_log.ood_data_dir", "image_log.seed_images",
          "the original's seed images of sample generation (rebm/eval/eval_utils.py:"
          "log_generate_images, compute_fid): a .pt image tensor or a folder of images, resized "
          "to data.image_size; `null` sets nothing"),
)


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
