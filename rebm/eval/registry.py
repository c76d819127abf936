"""The list of evaluation metrics, and the metric lists the entry points use.

To add a metric: write its module (a `Metric` subclass; see rebm/eval/metric.py for what it
defines) and add the class to the list that fills `METRICS` below (a rebm.registry.Registry
whose order is that list's, written down rather than an import order). Its name then works
everywhere: in an `Evaluator`'s metrics (rebm/eval/evaluator.py), in `--metrics` of `python -m rebm.eval.evaluate`, in `eval.metrics` of a
config (added to every evaluation, training's included); its settings go to eval.json, its
rows to the console table and its `summary_values` to the one-line summary (rebm/eval/results.py).
Metrics run, and are reported, in the order of `METRICS`; docs/evaluation.md's table of the
metrics lists them in that order (tests/test_evaluation_doc.py checks it).
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple, Type

from rebm.config.views import EvaluationSection
from rebm.eval.metric import EvalError, Metric
from rebm.eval.metrics.accuracy import CleanAccuracy, RobustAccuracy
from rebm.eval.metrics.autoattack import AutoAttackAccuracy
from rebm.eval.metrics.calibration import Calibration
from rebm.eval.metrics.counterfactuals import Counterfactuals
from rebm.eval.metrics.fid import FID
from rebm.eval.metrics.inception_score import InceptionScore
from rebm.eval.metrics.ood_detection import OODDetection
from rebm.eval.metrics.ood_sets import OODSets
from rebm.eval.metrics.precision_recall import PrecisionRecall
from rebm.eval.metrics.sample_files import KeepSamples, SampleGrid, SamplesNpz
from rebm.registry import Registry


class MetricRegistry(Registry[Type[Metric]]):
    """The metrics by name: an EvalError in the evaluation's wording for an unknown one."""

    def unknown_message(self, name: Any, source: str) -> str:
        names = self.names()
        return (f"unknown metric '{name}'; the metrics are {', '.join(names)}."
                f"{did_you_mean(str(name), names)}")


METRICS = MetricRegistry("metric", error=EvalError, cutoff=0.6)
for _metric in (  # the order the metrics run and are reported in
    CleanAccuracy,
    RobustAccuracy,
    AutoAttackAccuracy,
    Calibration,
    OODDetection,
    OODSets,
    Counterfactuals,
    SampleGrid,
    KeepSamples,
    SamplesNpz,
    FID,
    InceptionScore,
    PrecisionRecall,
):
    METRICS.add(_metric.name, _metric)


def metric_names() -> List[str]:
    return list(METRICS.names())


def did_you_mean(name: str, choices: Sequence[str]) -> str:
    """' Did you mean 'x'?' for the closest of `choices` to a mistyped `name`, else ''."""
    close = METRICS.closest(name, choices)
    return f" Did you mean '{close}'?" if close else ""


def metric_classes(names: Sequence[str]) -> List[Type[Metric]]:
    """The classes of `names`, in registry order; EvalError (one line) on an unknown name."""
    for name in names:
        METRICS.check(name)
    return [metric for name, metric in METRICS.items() if name in names]


def standard_metrics(evaluation: EvaluationSection, samples: bool, extra: Sequence[str] = ()
                     ) -> Tuple[str, ...]:
    """The usual metrics of an evaluation: clean accuracy, robust accuracy (`robust_eval`), with
    `samples` the sample grid, FID (`image_log.log_fid`) and every sample as PNG
    (`keep_samples`), then `eval.metrics` and `extra`, without repeats."""
    names = ["accuracy"] + (["robust_accuracy"] if evaluation.eval.robust_eval else [])
    if samples and evaluation.image_log.num_samples > 0:
        names.append("sample_grid")
        names += ["fid"] if evaluation.image_log.log_fid else []
        names += ["keep_samples"] if evaluation.eval.keep_samples else []
    return tuple(dict.fromkeys([*names, *evaluation.eval.metrics, *extra]))
