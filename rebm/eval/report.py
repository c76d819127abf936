"""Metric values as they are written: JSON-safe numbers for metrics.jsonl and eval.json."""

from __future__ import annotations

import math
from typing import Any

import torch


def jsonable(value: Any) -> Any:
    """A metric value as valid JSON: tensors to numbers, NaN to null, inf to +-1e308."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value
