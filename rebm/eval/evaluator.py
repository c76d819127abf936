"""One Evaluator per run: every evaluation of a run, whatever its front door (the Trainer's
periodic and final evaluation, `python -m rebm.eval.evaluate`, `python -m rebm.eval.table`,
stage 1's robustness test), goes through `Evaluator.evaluate_all_ranks`.

Built once from the evaluation section (`cfg.evaluation`), the runtime and the metric names
(rebm/eval/registry.py), the Evaluator holds what every evaluation of the run reuses:
- readiness: `problems()`, what the metrics need and this machine lacks (a weights or
  statistics file, a package), one line each; `start_all_ranks()` stops every rank on them
  with one line before any work, then builds the rest;
- the feature networks and reference statistics (`Metric.build`, at start), the seed source of
  the samples (at start: an unusable seed file stops the run now, not at its first evaluation),
  the real images' features of precision/recall (at their first evaluation): `resources`;
- the test images: this rank's chunks and their loader, built at the first evaluation.

`evaluate_all_ranks(model, step)` returns an `EvalResults`: the values, each metric's own
results, the settings each value was computed on, and the files written. The test-set metrics
share one pass over the test chunks (rebm/eval/test_set.py); the sample metrics share one
generation pass (rebm/eval/sampling/samples.py), after the metrics chose its step count (FID's adaptive
sweep). No constructor generates or gathers: what needs every rank is a method named
`..._all_ranks`, and the loops stop at their stop points (rebm.distributed.signals) when a stop
is asked for. The numbers are those of a single process on any world size.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Type

from torch import nn

from rebm.checkpoint.run_directory import RunDirectory
from rebm.checkpoint.weights import CheckpointError, load_checkpoint
from rebm.config import DataConfig, ModelConfig, eval_batch_size
from rebm.config.views import EvaluationSection
from rebm.distributed import Runtime
from rebm.distributed.collectives import on_every_rank
from rebm.distributed.parallel import unwrap
from rebm.eval.metric import SAMPLES, TEST_SET, EvalContext, EvalError, Metric
from rebm.eval.passes import eval_mode
from rebm.eval.registry import metric_classes
from rebm.eval.sampling.samples import run_sample_pass_all_ranks, seed_source
from rebm.eval.test_set import TestData, run_test_pass_all_ranks
from rebm.models import model_from_config

LOGGER = logging.getLogger("rebm")


@dataclass
class EvalResults:
    """What one evaluation gives, the same on every rank: `values` ({key: value}: "n_test"
    and each test-set metric's keys when one ran, each sample metric's keys), `by_metric`
    (each metric's own results), `settings` ({metric: what its value was computed on}) and
    `files` ({what: path} of the files it wrote, e.g. "sample_grid")."""

    values: Dict[str, Any] = field(default_factory=dict)
    by_metric: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    settings: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    files: Dict[str, str] = field(default_factory=dict)


class Evaluator:
    """The evaluations of one run (the module docstring). `metrics`: registry names (any order;
    they run in registry order); `batch_size`: images per rank and batch (None:
    `rebm.config.eval_batch_size`); `run_dir`: the folder for files (None: no files);
    `sections`: an evaluation section per metric name where one differs from `evaluation` (the
    table's metric_overrides). Building it is cheap and rank-local (an unknown name: EvalError)."""

    def __init__(self, evaluation: EvaluationSection, runtime: Runtime, metrics: Sequence[str], *,
                 batch_size: Optional[int] = None, run_dir: Optional[str] = None,
                 sections: Optional[Mapping[str, EvaluationSection]] = None):
        self.runtime, self.run_dir = runtime, run_dir
        self.classes: List[Type[Metric]] = metric_classes(metrics)
        self.sections = {cls.name: (sections or {}).get(cls.name, evaluation)
                         for cls in self.classes}
        self.batch_size = batch_size or eval_batch_size(evaluation.schedule, evaluation.eval, runtime.world_size)
        self.resources: Dict[str, Any] = {}  # feature networks, reference statistics, seeds
        self.test_data: List[Tuple[EvaluationSection, TestData]] = []  # built on first use
        self.started = False

    @property
    def names(self) -> List[str]:
        return [cls.name for cls in self.classes]

    def problems(self) -> List[str]:
        """What the metrics need and this machine lacks, one line each (`--check` prints them as
        warnings; `start_all_ranks` stops on them)."""
        return [p for cls in self.classes for p in cls.problems(self.sections[cls.name])]

    def settings(self) -> Dict[str, Dict[str, Any]]:
        """{metric: its settings}, in registry order (eval.json, cache keys)."""
        return {cls.name: cls.settings(self.sections[cls.name]) for cls in self.classes}

    def start_all_ranks(self) -> "Evaluator":
        """Before any work, on every rank: one EvalError line when the metrics lack something
        here (`problems`), then the feature networks, reference statistics and the samples'
        seed source; a failure on any rank stops every rank."""
        on_every_rank(self.runtime, self._start, "find the evaluation's files")
        return self

    def _start(self) -> None:
        problems = self.problems()
        if problems:
            raise EvalError("; ".join(problems))
        for cls in self.classes:
            cls.build(self.sections[cls.name], self.runtime, self.resources)
        for cls in self._of(SAMPLES, self.names):
            section = self.sections[cls.name]
            if section.image_log.num_samples > 0:
                seed_source(section, self.resources)
        self.started = True

    def _of(self, source: str, names: Sequence[str]) -> List[Type[Metric]]:
        return [cls for cls in self.classes if cls.source == source and cls.name in names]

    def evaluate_all_ranks(self, model: nn.Module, step: Optional[int] = None,
                           metrics: Optional[Sequence[str]] = None) -> EvalResults:
        """Evaluate `model` (wrapped or not; the unwrapped module is used, in eval mode for the
        call) on every rank: the Evaluator's metrics, or the subset `metrics`. `step` names the
        files of a training evaluation. Every rank calls this with the same arguments."""
        if not self.started:
            self.start_all_ranks()
        names = self.names if metrics is None else list(metrics)
        unknown = [n for n in names if n not in self.names]
        if unknown:
            raise EvalError(f"metric '{unknown[0]}' is not one of this evaluator's "
                            f"({', '.join(self.names)})")
        model = unwrap(model)
        eval_results = EvalResults(settings={n: s for n, s in self.settings().items()
                                             if n in names})
        with eval_mode(model):
            for group in self._test_groups(names):
                self._test_pass_all_ranks(model, step, group, eval_results)
            samples = self._of(SAMPLES, names)
            if samples and self.sections[samples[0].name].image_log.num_samples > 0:
                self._sample_pass_all_ranks(model, step, samples, eval_results)
        return eval_results

    def _context(self, model: nn.Module, cls: Type[Metric], step: Optional[int]) -> EvalContext:
        folder = None if self.run_dir is None else RunDirectory(self.run_dir)
        return EvalContext(model, self.sections[cls.name], self.runtime, self.batch_size,
                           folder, step, self.resources)

    def _test_groups(self, names: Sequence[str]) -> List[List[Type[Metric]]]:
        """The test-set metrics of `names` by the section they read (one pass each: the test
        images follow the section)."""
        groups: List[Tuple[EvaluationSection, List[Type[Metric]]]] = []
        for cls in self._of(TEST_SET, names):
            section = self.sections[cls.name]
            group = next((g for s, g in groups if s == section), None)
            if group is None:
                groups.append((section, [cls]))
            else:
                group.append(cls)
        return [group for _, group in groups]

    def _test_pass_all_ranks(self, model: nn.Module, step: Optional[int],
                             classes: List[Type[Metric]], eval_results: EvalResults) -> None:
        section = self.sections[classes[0].name]
        test_data = next((d for s, d in self.test_data if s == section), None)
        if test_data is None:  # sections equal in value read the same test images
            test_data = TestData(section, self.runtime, self.batch_size)
            self.test_data.append((section, test_data))
        metrics = [cls(self._context(model, cls, step)) for cls in classes]
        for metric in metrics:
            metric.start_all_ranks()
        n_test, results = run_test_pass_all_ranks(test_data, model, self.runtime, metrics)
        self._record(eval_results, metrics, results, {"n_test": n_test})

    def _sample_pass_all_ranks(self, model: nn.Module, step: Optional[int],
                               classes: List[Type[Metric]], eval_results: EvalResults) -> None:
        """One generation pass with the section of the first sample metric (the metrics of one
        call draw the same samples; each still reads its own section)."""
        ctx = self._context(model, classes[0], step)
        metrics = [cls(self._context(model, cls, step)) for cls in classes]
        for metric in metrics:
            metric.start_all_ranks()
        seeds = seed_source(ctx.evaluation, self.resources)
        results = run_sample_pass_all_ranks(ctx, seeds, metrics)
        self._record(eval_results, metrics, results)

    @staticmethod
    def _record(eval_results: EvalResults, metrics: List[Metric],
                results: List[Dict[str, Any]], shared: Optional[Dict[str, Any]] = None) -> None:
        eval_results.values.update(shared or {})
        for metric, found in zip(metrics, results, strict=True):
            eval_results.by_metric[metric.name] = {**(shared or {}), **found}
            eval_results.values.update(found)
            eval_results.files.update(metric.outputs())


def load_eval_model(model: ModelConfig, data: DataConfig, use_ema: bool,
                    runtime: Runtime) -> nn.Module:
    """The plain model of `model` and `data` with the weights of `model.ckpt_path` (EMA
    weights of a training state when `use_ema`), on this rank's device, never wrapped: evaluation
    runs no DDP forward."""
    path = model.ckpt_path
    if not path:
        raise EvalError("model.ckpt_path is not set; pass model.ckpt_path=PATH of the "
                        "checkpoint to evaluate")
    if not os.path.isfile(path):
        raise EvalError(f"model.ckpt_path '{path}' does not exist")
    network = model_from_config(model, data)
    try:
        load_checkpoint(network, path, prefer_ema=use_ema, trust=model.trust_checkpoint)
    except CheckpointError as err:
        raise EvalError(str(err)) from None
    return network.to(runtime.device).eval()
