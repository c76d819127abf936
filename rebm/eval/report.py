"""Metric values as they are written: JSON-safe numbers for metrics.jsonl and eval.json."""

from __future__ import annotations

import math
from typing import Any, Dict

import torch


def jsonable(value: Any) -> Any:
    """A metric value as valid JSON: tensors to numbers, NaN to null, inf to +-1e308."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


def describe_evaluation(results: Dict[str, Any]) -> str:
    """One readable line of an evaluation's numbers, e.g.
    'clean acc 0.994 | robust acc 0.858 | FID 12.31 | OOD AUROC 0.912 | ECE 0.021 (359 images)'."""
    parts = []
    for key, label, fmt in (("test_acc", "clean acc", "{:.3f}"),
                            ("robust_test_acc", "robust acc", "{:.3f}"),
                            ("autoattack_test_acc", "AutoAttack acc", "{:.3f}"),
                            ("fid", "FID", "{:.2f}"), ("ood_auroc", "OOD AUROC", "{:.3f}"),
                            ("ece", "ECE", "{:.3f}")):
        value = results.get(key)
        if isinstance(value, (int, float)):
            parts.append(f"{label} {fmt.format(value)}")
    line = " | ".join(parts) or "no metrics"
    return line + (f" ({results['n_test']} images)" if "n_test" in results else "")
