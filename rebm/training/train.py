"""DAT training entry point: `python -m rebm.training.train CONFIG [key=value ...]`.

Launch on N processes with `torchrun --nproc_per_node=N -m rebm.training.train CONFIG`. The loop
below reads like the method; processes, data positions and checkpoint files are handled by
rebm.distributed, rebm.training.data and rebm.training.state.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from rebm import distributed as dist_utils
from rebm.distributed import PreemptionFlag, Runtime, consensus
from rebm.errors import UserError
from rebm.eval.evaluate import evaluate_model
from rebm.training import cli
from rebm.training.checkpoint_io import save_model
from rebm.training.config_classes import (
    TrainConfig,
    ignored_fields_set,
    plan_batches,
)
from rebm.training.curriculum import Curriculum
from rebm.training.data import build_train_data
from rebm.training.ema import build_ema
from rebm.training.modeling import get_model, get_optimizer
from rebm.training.state import (
    StateError,
    agree_on_resume,
    load_training_state,
    replicas_identical,
    save_on_main,
    training_state,
)
from rebm.training.step import MetricsWindow, Precision, dat_step, global_aucs
from rebm.training.tracking import Tracker, progress_bar, resolve_run_dir

LOGGER = logging.getLogger("rebm")


class TrainingDiverged(UserError, FloatingPointError):
    """A NaN/Inf loss; all ranks stop at the same step."""


@dataclass
class Progress:
    """Where the run is. `step` counts optimizer steps done; the data position follows from it."""

    step: int = 0
    best: Dict[str, float] = field(default_factory=dict)
    window: MetricsWindow = field(default_factory=MetricsWindow)  # sums since the last log
    wandb_run_id: Optional[str] = None


@dataclass
class Parts:
    """Everything a training state holds, so saving/restoring is one place."""

    model: torch.nn.Module  # what forward/backward goes through (DDP / DataParallel / plain)
    raw_model: torch.nn.Module  # the unwrapped module: attacks, state dicts
    optimizer: torch.optim.Optimizer
    ema: Optional[torch.nn.Module]
    precision: Precision
    curriculum: Curriculum
    progress: Progress

    @property
    def eval_model(self) -> torch.nn.Module:
        """The model that is evaluated and exported: the EMA average when use_ema."""
        return self.ema.ema_model if self.ema is not None else self.raw_model

    @property
    def sync_batchnorm(self) -> bool:
        return any(isinstance(m, torch.nn.SyncBatchNorm) for m in self.raw_model.modules())

    @property
    def replicated(self) -> List[torch.nn.Module]:
        return [self.raw_model] + ([self.ema] if self.ema is not None else [])

    def state_dict(self, cfg: TrainConfig, world_size: int, wandb_run_id: Optional[str]) -> dict:
        return training_state(2, self.progress.step, self.raw_model, self.optimizer, self.ema,
                              self.precision, cfg, world_size, wandb_run_id,
                              curriculum=self.curriculum.state_dict(),
                              best=dict(self.progress.best))

    def load_state_dict(self, state: dict, is_main: bool) -> None:
        load_training_state(state, 2, self.raw_model, self.optimizer, self.ema, self.precision)
        self.curriculum.load_state_dict(state["curriculum"])
        self.progress = Progress(step=int(state["step"]), best=dict(state.get("best", {})),
                                 # the saved window is global: carried by rank 0 alone
                                 window=MetricsWindow.restored(state["metrics_window"], is_main),
                                 wandb_run_id=state.get("wandb_run_id"))


def crossed(interval_imgs: Optional[int], step: int, batch_size: int) -> bool:
    """True when the image counter passed a multiple of `interval_imgs` during `step`."""
    if not interval_imgs:
        return False
    return (step * batch_size) // interval_imgs > ((step - 1) * batch_size) // interval_imgs


def build_parts(cfg: TrainConfig, runtime: Runtime, load_pretrained: bool = True) -> Parts:
    torch.manual_seed(cfg.rand_seed)  # same initial weights on every rank (DDP also broadcasts)
    model, raw_model = get_model(cfg, runtime, load_pretrained=load_pretrained)
    return Parts(model=model, raw_model=raw_model,
                 optimizer=get_optimizer(cfg, raw_model.parameters()),
                 ema=build_ema(raw_model, cfg), precision=Precision.from_config(cfg, runtime.device),
                 curriculum=Curriculum.from_config(cfg), progress=Progress())


def resume_state(cfg: TrainConfig, runtime: Runtime, run_dir: str) -> Optional[dict]:
    """The state to resume from: resume_from_state, or the newest in run_dir (resume=auto), or
    None. Every rank takes part: the path is rank 0's decision, broadcast; every rank reads it."""
    return agree_on_resume(runtime, run_dir, cfg.resume_from_state,
                           allow_auto=cfg.resume == "auto")


def restore(parts: Parts, state: dict, runtime: Runtime) -> None:
    """Load a training state into every rank's parts and check that the replicas agree."""
    parts.load_state_dict(state, runtime.is_main)
    if not replicas_identical(runtime, *parts.replicated):
        raise StateError(f"after loading '{state['_path']}' the ranks' weights differ")
    LOGGER.info("resumed from %s at step %d (T=%d)", state["_path"], parts.progress.step,
                parts.curriculum.T)


def train(cfg: TrainConfig, runtime: Runtime) -> Dict[str, float]:
    started = time.perf_counter()
    plan = plan_batches(cfg, runtime.world_size)
    run_dir = resolve_run_dir(cfg, runtime)
    dist_utils.setup_logging(runtime, run_dir)
    LOGGER.info("run dir %s | world size %d | device %s | %d per device x %d accumulation",
                run_dir, runtime.world_size, runtime.device, plan.per_device_batch_size,
                plan.accumulation_steps)
    for key in ignored_fields_set(cfg):
        LOGGER.info("config field '%s' is accepted for compatibility but not used", key)

    state = resume_state(cfg, runtime, run_dir)
    # A resumed run takes its weights from the state: model.ckpt_path is not read again (the
    # pretrained file may have moved since the run started).
    parts = build_parts(cfg, runtime, load_pretrained=state is None)
    if state is not None:
        restore(parts, state, runtime)
    tracker = Tracker(cfg, runtime, run_dir, wandb_run_id=parts.progress.wandb_run_id)
    tracker.truncate_metrics_after(parts.progress.step)
    data = build_train_data(cfg, runtime, plan, start_step=parts.progress.step)
    batches = iter(data)
    preemption = PreemptionFlag().install()
    last_step = planned_last_step(cfg, data.steps_per_epoch)
    bar = progress_bar(runtime, parts.progress.step, last_step, cfg.batch_size)
    LOGGER.info("data: %s; training to step %s", data.describe(), last_step)
    parts.progress.window.started = time.perf_counter()  # images/s counts training only
    steps_run = 0

    # A collective timeout anywhere in the loop is reported with the rank(s) that did not arrive.
    with dist_utils.name_stuck_ranks(runtime, lambda: parts.progress.step + 1):
        while parts.progress.step < last_step:
            micro_batches = next(batches)
            if started is not None:  # start-up cost: O(1) in the resumed step, no batch replay
                LOGGER.info("first batch after %.2fs", time.perf_counter() - started)
                started = None
            step, metrics = train_one_step(parts, micro_batches, cfg, plan, runtime)
            bar.update(T=metrics.outdist_steps, auc=metrics.adv_auc)
            if steps_run == 0:  # start-up is over: from now on a missing rank surfaces quickly
                dist_utils.set_collective_timeout(runtime, cfg.ddp_step_timeout_s)
            steps_run += 1
            decision = consensus(runtime, preempt=preemption.raised,
                                 nonfinite=not metrics.finite)
            if decision["nonfinite"]:
                raise TrainingDiverged(
                    f"non-finite loss at step {step} on at least one rank; the newest state in "
                    f"{run_dir}/checkpoints is from before it (try a lower lr)")
            at_intervals(parts, metrics, cfg, runtime, tracker, data.epoch_of(step - 1))
            if decision["preempt"] and step < last_step:  # at the last step: just finish
                save_training_state(parts, cfg, runtime, run_dir, tracker)
                LOGGER.warning("preempted (%s on some rank): state saved at step %d; run the "
                               "same command with run_dir=%s to resume",
                               preemption.signal_name or "signal", step, run_dir)
                bar.close()
                return {"step": step, "preempted": True}
    bar.close()

    final_step = parts.progress.step
    if steps_run == 0:  # rerun of a finished run: its final evaluation and files exist already
        LOGGER.info("nothing to do: the run is already at step %d (raise max_steps or "
                    "total_epochs to continue it)", final_step)
        tracker.close()
        return {"step": final_step}
    if cfg.n_imgs_per_evaluation_log and not crossed(cfg.n_imgs_per_evaluation_log, final_step,
                                                     cfg.batch_size):
        evaluate_and_keep_best(parts, cfg, runtime, tracker, data.epoch_of(final_step - 1))
    # model_final first: once the final state exists, a rerun has nothing left to do
    if runtime.is_main:
        save_model(parts.eval_model, os.path.join(run_dir, "model_final.pth"))
    save_training_state(parts, cfg, runtime, run_dir, tracker)
    tracker.close()
    LOGGER.info("finished at step %d", final_step)
    return {"step": final_step}


def train_one_step(parts: Parts, micro_batches, cfg: TrainConfig, plan, runtime: Runtime):
    """The method, one optimizer step: attacks + losses + update (dat_step), EMA, curriculum."""
    step = parts.progress.step + 1
    outdist_steps = parts.curriculum.T  # the T this step trains with
    log_now = crossed(cfg.n_imgs_per_metrics_log, step, cfg.batch_size)
    metrics = dat_step(parts.model, parts.optimizer, micro_batches, outdist_steps, cfg, plan,
                       parts.precision, want_clean_scores=log_now)
    if cfg.model.use_batchnorm and not parts.sync_batchnorm:
        # per-rank batch statistics would make the replicas (and their EMA) drift apart
        dist_utils.broadcast_buffers(runtime, parts.raw_model)
    if parts.ema is not None:
        parts.ema.update()
    parts.progress.step = step
    # AUCs of the all-gathered global batch: the same T schedule on any number of ranks.
    metrics.adv_auc, metrics.clean_auc = global_aucs(runtime, metrics)
    metrics.outdist_steps = outdist_steps
    parts.curriculum.update(metrics.adv_auc, cfg.batch_size)
    parts.progress.window.add(metrics)
    return step, metrics


def at_intervals(parts: Parts, metrics, cfg: TrainConfig, runtime: Runtime, tracker: Tracker,
                 epoch: int) -> None:
    """Metrics, image grids, evaluation and checkpoints, each every so many images. Every rank
    calls this: the intervals depend only on the step, so all ranks reach the same collectives."""
    step = parts.progress.step
    progress = parts.progress
    if crossed(cfg.n_imgs_per_metrics_log, step, cfg.batch_size):
        elapsed = time.perf_counter() - progress.window.started
        summary = progress.window.summary(runtime, elapsed, cfg, adv_auc=metrics.adv_auc,
                                          clean_auc=metrics.clean_auc,
                                          outdist_steps=metrics.outdist_steps)
        summary["replicas_identical"] = replicas_identical(runtime, *parts.replicated)
        tracker.log(step, step * cfg.batch_size, epoch, summary)
        progress.window = MetricsWindow()
    if crossed(cfg.n_imgs_per_image_log, step, cfg.batch_size):
        tracker.save_grid(metrics.x_adv_preview, f"train_adv_step{step:07d}.png")
    if crossed(cfg.n_imgs_per_evaluation_log, step, cfg.batch_size):
        evaluate_and_keep_best(parts, cfg, runtime, tracker, epoch)
    if crossed(cfg.n_imgs_per_ckpt_save, step, cfg.batch_size):
        save_training_state(parts, cfg, runtime, tracker.run_dir, tracker)


def evaluate_and_keep_best(parts: Parts, cfg: TrainConfig, runtime: Runtime, tracker: Tracker,
                           epoch: int) -> Dict[str, float]:
    """Every rank evaluates its shard; rank 0 records and keeps the best models."""
    step = parts.progress.step
    results = evaluate_model(parts.eval_model, cfg, runtime, run_dir=tracker.run_dir, step=step)
    tracker.log(step, step * cfg.batch_size, epoch, results)
    for metric, filename, higher_is_better in (
        ("robust_test_acc" if cfg.robust_eval else "test_acc", "model_bestacc.pth", True),
        ("fid", "model_bestfid.pth", False),
    ):
        value = results.get(metric)
        if value is None:
            continue
        best = parts.progress.best.get(metric)
        if best is None or (value > best if higher_is_better else value < best):
            parts.progress.best[metric] = value
            if runtime.is_main:
                save_model(parts.eval_model, os.path.join(tracker.run_dir, filename))
    return results


def planned_last_step(cfg: TrainConfig, steps_per_epoch: int) -> int:
    """The step the run trains to: the first of max_steps and total_epochs (inf if neither)."""
    limits = []
    if cfg.max_steps is not None:
        limits.append(cfg.max_steps)
    if cfg.total_epochs is not None:
        limits.append(cfg.total_epochs * steps_per_epoch)
    return min(limits) if limits else math.inf  # type: ignore[return-value]


def save_training_state(parts: Parts, cfg: TrainConfig, runtime: Runtime, run_dir: str,
                        tracker: Tracker) -> None:
    """Rank 0 writes the state, every rank learns whether that worked (`save_on_main`)."""
    window_sums = parts.progress.window.global_sums(runtime)  # every rank: an all-reduce
    save_on_main(runtime, lambda: parts.state_dict(cfg, runtime.world_size, tracker.wandb_run_id)
                 | {"metrics_window": window_sums}, run_dir, cfg.keep_last_states)


@record
def main(argv: Optional[List[str]] = None) -> int:
    parser = cli.build_parser("rebm.training.train", __doc__.splitlines()[0])
    return cli.run_entry(parser, argv, lambda cfg, runtime, _args: train(cfg, runtime))


if __name__ == "__main__":
    sys.exit(main())
