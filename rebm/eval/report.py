"""Metric values as they are written and shown: JSON-safe numbers for metrics.jsonl and
eval.json, one summary line for the training log, and the evaluation's console table (each value
with what it was computed on: the attack, the samples, the out-distribution, the test images)."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch

from rebm.eval.registry import metric_classes


def jsonable(value: Any) -> Any:
    """A metric value (or a settings dict) as valid JSON: tensors to numbers, NaN to null, an
    infinity to the string "inf" or "-inf" (JSON has none; `float()` reads the strings back, and
    a radius written `.inf` in the config reads as such), inside dicts and lists too."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def describe_evaluation(results: Dict[str, Any]) -> str:
    """One readable line of an evaluation's numbers, e.g.
    'clean acc 0.994 | robust acc 0.858 | FID 12.31 | OOD AUROC 0.912 | ECE 0.021 (359 test images)'."""
    parts = []
    for key, label, fmt in (("test_acc", "clean acc", "{:.3f}"),
                            ("robust_test_acc", "robust acc", "{:.3f}"),
                            ("autoattack_test_acc", "AutoAttack acc", "{:.3f}"),
                            ("fid", "FID", "{:.2f}"), ("fid_unverified", "UNVERIFIED-weights FID", "{:.2f}"),
                            ("fid_standin", "stand-in FID", "{:.2f}"),
                            ("inception_score", "IS", "{:.2f}"),
                            ("ood_auroc", "OOD AUROC", "{:.3f}"), ("ece", "ECE", "{:.3f}")):
        value = results.get(key)
        if isinstance(value, (int, float)):
            parts.append(f"{label} {fmt.format(value)}")
    line = " | ".join(parts) or "no metrics"
    return line + (f" ({results['n_test']} test images)" if "n_test" in results else "")


def evaluation_rows(results: Dict[str, Any], settings: Dict[str, Dict[str, Any]]
                    ) -> List[Tuple[str, str, str]]:
    """(metric, value, settings text) rows of the metrics in `settings` (registry order)."""
    rows: List[Tuple[str, str, str]] = []
    for metric in metric_classes(list(settings)):
        try:
            rows += metric.describe(results, settings[metric.name])
        except KeyError:  # the metric produced no value (FID skipped, no samples): no row
            continue
    return rows


def evaluation_table(results: Dict[str, Any], settings: Dict[str, Dict[str, Any]]) -> str:
    """The console table of an evaluation: one row per value, with its settings."""
    rows = [("metric", "value", "computed on")] + evaluation_rows(results, settings)
    if len(rows) == 1:
        return "no metrics"
    width = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{a:<{width[0]}}  {b:>{width[1]}}  {c}" for a, b, c in rows)
