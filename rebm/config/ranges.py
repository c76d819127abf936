"""The range of values each numeric key's consumer can hold, checked when a config loads.

A value its consumer cannot hold passes OmegaConf's type check and fails far from the key that
set it, as a library's error: `lr=1e308` becomes an optimizer hyperparameter in float32 (Adam:
"value cannot be converted to type float without overflow"), `rand_seed=1e20` a generator's int64
seed ("Overflow when unpacking long long"), a timeout of 0 a collective that fails at once.
`check_ranges` names the key in one line instead. Every numeric field has a range: its own in
`KEY_RANGES`, else that of its type (`TYPE_RANGES`). The lower bounds of counts and weights (> 0,
>= 0) are loading.validate's; these are the bounds of what the consumer can represent.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple

from rebm.config.errors import ConfigError
from rebm.config.layout import file_leaves

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32
# Torch computes a collective's deadline as now + timeout in int64 nanoseconds (292 years in
# all): a bound well inside it, and beyond any real wait.
TIMEOUT_MAX_S = 10**9


@dataclass(frozen=True)
class Range:
    """Allowed values: [low, high], or (low, high] with `low_open`; `holder` says what holds them."""

    low: float
    high: float
    holder: str
    low_open: bool = False

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high

    def text(self) -> str:
        def number(bound: float) -> str:
            return str(bound) if isinstance(bound, int) else f"{bound:.3g}"

        return f"{'(' if self.low_open else '['}{number(self.low)}, {number(self.high)}]"


TYPE_RANGES = {
    int: Range(INT64_MIN, INT64_MAX, "an int64 (torch's integer)"),
    float: Range(-FLOAT32_MAX, FLOAT32_MAX, "a float32 (what tensors and the optimizer's "
                 "hyperparameters hold)"),
}
_TIMEOUT = Range(0, TIMEOUT_MAX_S, "a collective timeout in seconds (a timeout of 0 or less "
                 "is none)", low_open=True)
KEY_RANGES: Dict[str, Range] = {
    "rand_seed": Range(0, INT64_MAX, "a seed of torch's and numpy's generators (a "
                       "non-negative int64)"),
    "ddp_timeout_s": _TIMEOUT,
    "ddp_step_timeout_s": _TIMEOUT,
}


def _numeric_type(annotation: Any) -> Tuple[Optional[type], bool]:
    """(int or float, whether it is a list of them) of a field's annotation; (None, False) for
    anything else (a bool is not a number here)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        kinds = [a for a in args if a is not type(None)]
        return _numeric_type(kinds[0]) if len(kinds) == 1 else (None, False)
    if origin in (list, typing.List) and args:
        kind, _ = _numeric_type(args[0])
        return kind, kind is not None
    return (annotation, False) if annotation in (int, float) else (None, False)


def numeric_keys(cfg: Any) -> Iterator[Tuple[str, type, bool, Any]]:
    """(file key, int or float, whether a list, value) of every numeric key of `cfg`."""
    hints: Dict[type, Dict[str, Any]] = {}
    for key, _, owner, field in file_leaves(cfg):
        section = type(owner)
        if section not in hints:
            hints[section] = typing.get_type_hints(section)
        kind, listed = _numeric_type(hints[section][field.name])
        if kind is not None:
            yield key, kind, listed, getattr(owner, field.name)


def key_range(key: str, kind: type) -> Range:
    return KEY_RANGES.get(key, TYPE_RANGES[kind])


def check_ranges(cfg: Any, source: str) -> None:
    """ConfigError naming the first numeric key whose value its consumer cannot hold. An
    infinite radius (`eps`, `*_eps`: no radius) is loading.validate's to allow."""
    for key, kind, listed, value in numeric_keys(cfg):
        allowed = key_range(key, kind)
        for item in (value or ()) if listed else (value,):
            if item is None or (kind is float and abs(item) == float("inf")):
                continue
            if not allowed.holds(item):
                raise ConfigError(
                    f"{source}: '{key}: {item}' is out of range for {allowed.holder}; set a "
                    f"value in {allowed.text()}")
