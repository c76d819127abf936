"""Metric values as they are written and shown: JSON-safe numbers for metrics.jsonl and
eval.json, one summary line for the training log, and the evaluation's console table (each value
with what it was computed on: the attack, the samples, the out-distribution, the test images)."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch

from rebm.eval.features.network import INCEPTION, STANDIN, UNVERIFIED, FeatureNetwork
from rebm.eval.registry import metric_classes, metric_names


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


# A value computed with a feature network other than the verified Inception is stored under a
# key of its own (rebm/eval/features/network.py); the summary names that network in its label,
# so that a stand-in or unverified number never reads as an Inception one.
NETWORK_LABEL_PREFIXES = ((INCEPTION, ""), (UNVERIFIED, "UNVERIFIED-weights "),
                          (STANDIN, "stand-in "))


def summary_parts(results: Dict[str, Any]) -> List[str]:
    """'label value' of every registered metric's summary values found in `results`, in
    registry order (`Metric.summary_values`)."""
    parts, seen = [], set()
    for metric in metric_classes(metric_names()):
        for key, label, fmt in metric.summary_values():
            for kind, prefix in NETWORK_LABEL_PREFIXES:
                shown_key = FeatureNetwork(kind).key(key)
                value = results.get(shown_key)
                # numbers only (a bool is an int in Python but no value); each key once
                if (shown_key in seen or isinstance(value, bool)
                        or not isinstance(value, (int, float))):
                    continue
                seen.add(shown_key)
                parts.append(f"{prefix}{label} {fmt.format(value)}")
    return parts


def describe_evaluation(results: Dict[str, Any]) -> str:
    """One readable line of an evaluation's numbers (the training log's and
    `rebm.eval.evaluate`'s), every registered metric's `summary_values`, e.g.
    'clean acc 0.994 | robust acc 0.858 | ECE 0.021 | OOD AUROC 0.912 | stand-in FID 12.31
    (359 test images)'."""
    line = " | ".join(summary_parts(results)) or "no metrics"
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
