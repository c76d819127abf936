"""The evaluation of a model, on every rank: `evaluate_model` (the training loop's periodic and
final evaluation, and the `python -m rebm.eval.evaluate` entry's work).

The test set is sharded over the ranks and the numbers are those of a single process. Computes clean accuracy, robust accuracy (PGD with `indist_attack_clf`, when `robust_eval`) and
ECE; optionally class-conditional samples (+ FID when `image_log.log_fid`, after the step sweep
with `image_log.adaptive_steps`; every sample as a PNG with `keep_samples`), OOD-detection AUROC
and AutoAttack (docs/evaluation.md). A missing FID weights or statistics file stops the run
before any work, in one line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Dict, Optional

import torch
from torch import Tensor, nn

from rebm.checkpoint.weights import CheckpointError, load_checkpoint
from rebm.config import eval_batch_size
from rebm.data import build_eval_data
from rebm.distributed import Runtime
from rebm.distributed.collectives import on_main
from rebm.distributed.parallel import unwrap
from rebm.errors import UserError
from rebm.eval.accuracy import evaluate_accuracy
from rebm.eval.calibration import evaluate_ece
from rebm.eval.fid import Features, fid_scorer, to_8bit
from rebm.eval.generation import generate_samples, save_grid
from rebm.eval.ood import build_ood_data, evaluate_ood
from rebm.eval.sweep import sweep_steps, with_steps
from rebm.models import model_from_config

LOGGER = logging.getLogger("rebm")


class EvalError(UserError, ValueError):
    """The evaluation cannot start (no checkpoint, unreadable checkpoint); one line."""


def robust_eval_attack(cfg):
    """The indist_attack_clf threat model, with `robust_eval_steps` PGD steps when set (robust
    evaluation usually wants more steps than adversarial training uses)."""
    if cfg.robust_eval_steps is None:
        return cfg.indist_attack_clf
    return dataclasses.replace(cfg.indist_attack_clf, max_steps=cfg.robust_eval_steps)


def evaluate_model(
    model: nn.Module,
    cfg,
    runtime: Runtime,
    batch_size: Optional[int] = None,
    run_dir: Optional[str] = None,
    step: Optional[int] = None,
    loader=None,
    samples: bool = True,
    ece: bool = False,
    ood: bool = False,
    autoattack: bool = False,
) -> Dict[str, Any]:
    """Evaluate `model` (wrapped or not; the unwrapped module is used) on every rank.

    Returns the same dict on every rank: "test_acc", "n_test", "robust_test_acc" (when
    cfg.robust_eval), "fid" (when samples are drawn, image_log.log_fid is set and FID can be
    computed here; see `sample_metrics` for the sweep), "ece" / "ood_auroc" / "autoattack_test_acc" when asked for. With `samples`,
    rank 0 saves a PNG grid into <run_dir>/samples/. Pass `loader` (from `build_eval_data`) to
    reuse one across calls. `batch_size`: images per rank and batch (default: the batch plan's
    evaluation batch, `rebm.config.eval_batch_size`). Every rank must call this with the same
    arguments.
    """
    model = unwrap(model)
    batch_size = batch_size or eval_batch_size(cfg, runtime.world_size)
    if loader is None:
        loader = build_eval_data(cfg, runtime, batch_size)
    metrics: Dict[str, Any] = evaluate_accuracy(
        model, loader, runtime, robust_eval_attack(cfg), robust=cfg.robust_eval,
        seed=cfg.rand_seed, autoattack=autoattack, num_classes=cfg.data.num_classes,
    )
    if ece:
        metrics["ece"] = evaluate_ece(model, loader, runtime)
    if ood:
        ood_loader = build_ood_data(cfg, runtime, batch_size, num_samples=metrics["n_test"])
        metrics.update(evaluate_ood(model, loader, ood_loader, runtime,
                                    score="lse" if cfg.logsumexp else "max_softmax"))
    if samples and cfg.image_log.num_samples > 0:
        metrics.update(sample_metrics(model, cfg, runtime, batch_size, run_dir, step))
    return metrics


def sample_metrics(model: nn.Module, cfg, runtime: Runtime, batch_size: int,
                   run_dir: Optional[str] = None, step: Optional[int] = None,
                   features: Optional[Features] = None) -> Dict[str, Any]:
    """Class-conditional samples: the PNG grid (and every sample with `keep_samples`), and with
    image_log.log_fid their "fid"; with image_log.adaptive_steps first the step sweep
    ("fid_best_steps", "fid_sweep/<steps>"). `features`: a stand-in for Inception (tests).
    Every rank must call this."""
    metrics: Dict[str, Any] = {}
    scorer = fid_scorer(cfg, runtime, batch_size, features) if cfg.image_log.log_fid else None
    if scorer is not None and cfg.image_log.adaptive_steps:
        best, fids = sweep_steps(model, cfg, runtime, scorer, batch_size)
        metrics["fid_best_steps"] = best
        metrics.update({f"fid_sweep/{s}": value for s, value in fids.items()})
        cfg = with_steps(cfg, best)
    images, _ = generate_samples(model, cfg, runtime, batch_size=batch_size)
    if run_dir is not None:
        on_main(runtime, lambda: _write_samples(images, run_dir, cfg, step),
                f"write the samples into {run_dir}/samples")
    if scorer is not None:
        fid = scorer(images)
        if fid is not None:
            metrics["fid"] = fid
    return metrics


def _write_samples(images: Tensor, run_dir: str, cfg, step: Optional[int]) -> None:
    path = save_grid(images, run_dir, cfg.data.num_classes, step)
    LOGGER.info("samples saved to %s", path)
    if cfg.keep_samples:
        LOGGER.info("every sample saved to %s", save_sample_files(images, run_dir, step))


def save_sample_files(images: Tensor, run_dir: str, step: Optional[int] = None) -> str:
    """Sample i as <run_dir>/samples/step_<8-digit step>/<i>.png (samples/eval/ without a step),
    8-bit like the images FID sees. Rank 0 only calls this; returns the folder."""
    from PIL import Image

    name = "eval" if step is None else f"step_{step:08d}"
    folder = os.path.join(run_dir, "samples", name)
    os.makedirs(folder, exist_ok=True)
    pixels = to_8bit(images.detach().cpu()).mul(255).round().to(torch.uint8)
    for index, image in enumerate(pixels.permute(0, 2, 3, 1).numpy()):
        Image.fromarray(image).save(os.path.join(folder, f"{index}.png"))
    return folder


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
