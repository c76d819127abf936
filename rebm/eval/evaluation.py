"""The evaluation of a model, on every rank: `evaluate_model(model, cfg, runtime, spec)` (the
training loop's periodic and final evaluation, and the `python -m rebm.eval.evaluate` entry's
work).

The spec (rebm/eval/metric.py) names the registered metrics (rebm/eval/registry.py). The test-set
metrics share one pass over the test chunks (rebm/eval/test_set.py); the sample metrics share one
generation pass (rebm/eval/samples.py), in memory that does not grow with the number of samples.
The numbers are those of a single process on any world size. Entry points call `require_ready`
first: what a metric needs and this machine lacks (a FID weights or statistics file, a package)
stops them before any work, in one line.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Optional

from torch import nn

from rebm.checkpoint.weights import CheckpointError, load_checkpoint
from rebm.config import eval_batch_size
from rebm.distributed import Runtime
from rebm.distributed.parallel import unwrap
from rebm.eval.accuracy import eval_mode, robust_eval_attack
from rebm.eval.metric import SAMPLES, TEST_SET, EvalContext, EvalError, EvalSpec
from rebm.eval.registry import metric_classes, metric_problems, standard_metrics
from rebm.eval.samples import run_sample_pass
from rebm.eval.test_set import run_test_pass
from rebm.models import model_from_config

LOGGER = logging.getLogger("rebm")

__all__ = ["EvalError", "EvalSpec", "evaluate_model", "load_eval_model", "require_ready",
           "robust_eval_attack"]


def evaluate_model(model: nn.Module, cfg, runtime: Runtime, spec: Optional[EvalSpec] = None,
                   **legacy: Any) -> Dict[str, Any]:
    """Evaluate `model` (wrapped or not; the unwrapped module is used, in eval mode for the
    call) on every rank: the metrics of `spec`. Returns the same {key: value} dict on every rank:
    "n_test" and each test-set metric's keys when any test-set metric runs, each sample metric's
    keys when image_log.num_samples > 0. Every rank must call this with the same spec.

    `legacy`: the keywords of the call before specs (batch_size, run_dir, step, samples, ece,
    ood, autoattack), accepted until every caller passes a spec."""
    spec = spec or spec_from_keywords(cfg, **legacy)
    model = unwrap(model)
    batch_size = spec.batch_size or eval_batch_size(cfg, runtime.world_size)
    ctx = EvalContext(model, cfg, runtime, spec, batch_size)
    classes = metric_classes(spec.metrics)
    results: Dict[str, Any] = {}
    with eval_mode(model):
        tests = [m(ctx) for m in classes if m.source == TEST_SET]
        if tests:
            results.update(run_test_pass(ctx, tests))
        if cfg.image_log.num_samples > 0:
            samples = [m(ctx) for m in classes if m.source == SAMPLES]
            if samples:
                results.update(run_sample_pass(ctx, samples))
    return results


def require_ready(cfg, spec: EvalSpec) -> None:
    """At the start of an entry point, before any work: one EvalError line naming what the
    spec's metrics need and this machine lacks (`--check` prints the same as warnings)."""
    problems = metric_problems(cfg, spec.metrics)
    if problems:
        raise EvalError("; ".join(problems))


def spec_from_keywords(cfg, batch_size: Optional[int] = None, run_dir: Optional[str] = None,
                       step: Optional[int] = None, samples: bool = True, ece: bool = False,
                       ood: bool = False, autoattack: bool = False) -> EvalSpec:
    """The spec of the keywords `evaluate_model` took before specs."""
    extra = [name for name, on in (("ece", ece), ("ood", ood), ("autoattack", autoattack)) if on]
    return EvalSpec(standard_metrics(cfg, samples, extra), batch_size, run_dir, step)


def load_eval_model(cfg, runtime: Runtime) -> nn.Module:
    """The plain model with the weights of `model.ckpt_path` (EMA weights of a training state
    when use_ema), on this rank's device, never wrapped: evaluation runs no DDP forward."""
    path = cfg.model.ckpt_path
    if not path:
        raise EvalError("model.ckpt_path is not set; pass model.ckpt_path=PATH of the "
                        "checkpoint to evaluate")
    if not os.path.isfile(path):
        raise EvalError(f"model.ckpt_path '{path}' does not exist")
    model = model_from_config(cfg)
    try:
        load_checkpoint(model, path, prefer_ema=cfg.use_ema, trust=cfg.model.trust_checkpoint)
    except CheckpointError as err:
        raise EvalError(str(err)) from None
    return model.to(runtime.device).eval()
