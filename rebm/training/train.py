"""DAT training entry point: `python -m rebm.training.train CONFIG [key=value ...]`.

Launch on N processes with `torchrun --nproc_per_node=N -m rebm.training.train CONFIG`. The loop
below reads like the method; processes, data positions and checkpoint files are handled by
rebm.distributed, rebm.training.data and rebm.training.state.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from rebm import distributed as dist_utils
from rebm.distributed import PreemptionFlag, Runtime, consensus, setup_distributed, teardown
from rebm.training import cli
from rebm.training.checkpoint_io import save_model
from rebm.training.config_classes import (
    TrainConfig,
    ignored_fields_set,
    plan_batches,
    to_dict,
)
from rebm.training.curriculum import Curriculum
from rebm.training.data import build_train_data
from rebm.training.ema import build_ema
from rebm.training.modeling import get_model, get_optimizer
from rebm.training.state import (
    StateError,
    agree_on_resume,
    replicas_identical,
    rng_state,
    save_state,
    set_rng_state,
)
from rebm.training.step import Precision, StepMetrics, dat_step, global_aucs
from rebm.training.tracking import Tracker, resolve_run_dir

LOGGER = logging.getLogger("rebm")


@dataclass
class Progress:
    """Where the run is. `step` counts optimizer steps done; the data position follows from it."""

    step: int = 0
    best: Dict[str, float] = field(default_factory=dict)
    wandb_run_id: Optional[str] = None


def crossed(interval_imgs: Optional[int], step: int, batch_size: int) -> bool:
    """True when the image counter passed a multiple of `interval_imgs` during `step`."""
    if not interval_imgs:
        return False
    return (step * batch_size) // interval_imgs > ((step - 1) * batch_size) // interval_imgs


def train(cfg: TrainConfig, runtime: Runtime) -> Dict[str, float]:
    plan = plan_batches(cfg, runtime.world_size)
    run_dir = resolve_run_dir(cfg, runtime)
    dist_utils.setup_logging(runtime, run_dir)
    LOGGER.info("run dir %s | world size %d | device %s | %d per device x %d accumulation",
                run_dir, runtime.world_size, runtime.device, plan.per_device_batch_size,
                plan.accumulation_steps)
    for key in ignored_fields_set(cfg):
        LOGGER.info("config field '%s' is accepted for compatibility but not used", key)
    torch.manual_seed(cfg.rand_seed)  # same initial weights on every rank (DDP also broadcasts)

    model, raw_model = get_model(cfg, runtime)
    optimizer = get_optimizer(cfg, raw_model.parameters())
    ema = build_ema(raw_model, cfg)
    precision = Precision.from_config(cfg, runtime.device)
    curriculum = Curriculum.from_config(cfg)
    progress = Progress()

    averaged_and_raw = [raw_model] + ([ema] if ema is not None else [])
    restored = agree_on_resume(runtime, run_dir, cfg.resume_from_state,
                               allow_auto=cfg.resume == "auto")
    if restored is not None:
        raw_model.load_state_dict(restored["model"])
        optimizer.load_state_dict(restored["optimizer"])
        if ema is not None and restored.get("ema") is not None:
            ema.load_state_dict(restored["ema"])
        precision.load_state_dict(restored.get("scaler"))
        curriculum.load_state_dict(restored["curriculum"])
        set_rng_state(restored["rng"])
        progress = Progress(step=int(restored["step"]), best=dict(restored.get("best", {})),
                            wandb_run_id=restored.get("wandb_run_id"))
        if not replicas_identical(runtime, *averaged_and_raw):
            raise StateError("after loading the state the ranks' weights differ; aborting")
        LOGGER.info("resumed from %s at step %d (T=%d)", restored["_path"], progress.step,
                    curriculum.T)

    tracker = Tracker(cfg, runtime, run_dir, wandb_run_id=progress.wandb_run_id)
    tracker.truncate_metrics_after(progress.step)
    data = build_train_data(cfg, runtime, plan, start_step=progress.step)
    preemption = PreemptionFlag().install()
    last_step = _last_step(cfg, data.steps_per_epoch)
    state_args = (cfg, run_dir, raw_model, optimizer, ema, precision, curriculum, progress,
                  tracker)

    window = StepMetrics.window()
    timer = time.perf_counter()
    batches = iter(data)
    while progress.step < last_step:
        step = progress.step + 1
        log_now = crossed(cfg.n_imgs_per_metrics_log, step, cfg.batch_size)
        metrics = dat_step(model, optimizer, next(batches), curriculum.T, cfg, plan,
                           precision, want_clean_scores=log_now)
        if ema is not None:
            ema.update()
        progress.step = step
        adv_auc, clean_auc = global_aucs(runtime, metrics)
        outdist_steps = curriculum.T  # the T this step trained with
        curriculum.update(adv_auc, cfg.batch_size)
        window.add(metrics)
        if step == 1:  # start-up is over: from now on a missing rank should surface quickly
            dist_utils.set_collective_timeout(runtime, cfg.ddp_step_timeout_s)

        decision = consensus(runtime, preempt=preemption.raised, nonfinite=not metrics.finite)
        if decision["nonfinite"]:
            raise FloatingPointError(
                f"non-finite loss at step {step} on at least one rank; the newest state in "
                f"{run_dir}/checkpoints is from before it (try a lower lr)")
        if log_now:
            elapsed, timer = time.perf_counter() - timer, time.perf_counter()
            summary = window.summary(runtime, elapsed, cfg, adv_auc=adv_auc,
                                     clean_auc=clean_auc, outdist_steps=outdist_steps)
            summary["replicas_identical"] = replicas_identical(runtime, *averaged_and_raw)
            tracker.log(step, step * cfg.batch_size, data.epoch_of(step - 1), summary)
            window = StepMetrics.window()
        if crossed(cfg.n_imgs_per_image_log, step, cfg.batch_size):
            tracker.save_grid(metrics.x_adv_preview, f"train_adv_step{step:07d}.png")
        if decision["preempt"]:
            _checkpoint(*state_args)
            LOGGER.warning("preempted (%s on some rank): state saved at step %d; run the same "
                           "command to resume", preemption.signal_name or "signal", step)
            return {"step": step, "preempted": True}
        if crossed(cfg.n_imgs_per_ckpt_save, step, cfg.batch_size):
            _checkpoint(*state_args)

    _checkpoint(*state_args)
    final_model = ema.ema_model if ema is not None else raw_model
    if runtime.is_main:
        save_model(final_model, f"{run_dir}/model_final.pth")
    tracker.close()
    LOGGER.info("finished at step %d", progress.step)
    return {"step": progress.step}


def _last_step(cfg: TrainConfig, steps_per_epoch: int) -> int:
    limits = []
    if cfg.max_steps is not None:
        limits.append(cfg.max_steps)
    if cfg.total_epochs is not None:
        limits.append(cfg.total_epochs * steps_per_epoch)
    return min(limits) if limits else math.inf  # type: ignore[return-value]


def _checkpoint(cfg, run_dir, raw_model, optimizer, ema, precision, curriculum, progress,
                tracker) -> None:
    """Rank 0 writes the state; every rank then learns whether the write worked (a consensus,
    so a full disk stops all ranks with the same clear error instead of a hang)."""
    failure: Optional[str] = None
    runtime = tracker.runtime
    if runtime.is_main:
        state = {
            "step": progress.step,
            "model": raw_model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "ema": ema.state_dict() if ema is not None else None,
            "scaler": precision.state_dict(),
            "curriculum": curriculum.state_dict(),
            "best": dict(progress.best),
            "rng": rng_state(),
            "wandb_run_id": tracker.wandb_run_id,
            "world_size": runtime.world_size,
            "config": to_dict(cfg),
        }
        try:
            save_state(state, run_dir, cfg.keep_last_states)
        except StateError as err:
            failure = str(err)
    if consensus(runtime, failed=failure is not None)["failed"]:
        raise StateError(failure or "rank 0 could not write the training state (see its log)")


@record
def main(argv: Optional[List[str]] = None) -> int:
    parser = cli.build_parser("rebm.training.train", __doc__.splitlines()[0])
    with cli.user_errors_exit():
        args, cfg = cli.parse_and_load(parser, argv)
        if args.check:
            return cli.check_config(cfg)
        runtime = setup_distributed(use_ddp=cfg.use_ddp, backend=cfg.ddp_backend,
                                    device=cfg.device, timeout_s=cfg.ddp_timeout_s)
        try:
            train(cfg, runtime)
        finally:
            teardown(runtime)
    return 0


if __name__ == "__main__":
    sys.exit(main())
