"""Spellings of the original configs that name a field of rebm's under another key.

Serves: the original DAT configs' own names (`fp16`, `resume_path`, `image_log.ood_data_dir`),
so its experiment files load unchanged; rebm/config/aliases.py renames them on each source's raw
mapping before the merge, and configs.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple


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
