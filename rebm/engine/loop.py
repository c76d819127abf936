"""The one training loop, for every stage: `train(cfg, runtime, method_factory)`.

The loop reads like a training loop; the method (rebm.methods) owns the step, and processes, data
positions and checkpoint files are handled by rebm.distributed, rebm.data and rebm.checkpoint.
Every rank runs every line below: intervals depend only on the step, decisions go through one
consensus per step, and rank 0's writes sit behind inert objects (Tracker) or `save_on_main`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional

import torch

from rebm.checkpoint.state import (
    agree_on_resume,
    check_stage,
    replicas_identical,
    save_on_main,
)
from rebm.checkpoint.weights import save_model
from rebm.config import (
    BatchPlan,
    ConfigError,
    TrainConfig,
    ignored_fields_set,
    plan_batches,
    to_dict,
    training_diff,
)
from rebm.data import build_train_data
from rebm.distributed import compile_cache
from rebm.distributed.collectives import (
    broadcast_buffers,
    consensus,
    decide_on_main,
    name_stuck_ranks,
    on_every_rank,
    on_main,
    set_collective_timeout,
)
from rebm.distributed.logs import setup_logging
from rebm.distributed.runtime import Runtime
from rebm.distributed.signals import Preempted, PreemptionFlag
from rebm.engine.metrics import MetricsWindow, add_data_counts, peak_memory, pop_data_counts
from rebm.engine.parts import Parts, build_parts
from rebm.engine.rundir import resolve_run_dir
from rebm.engine.tracking import Tracker, progress_bar
from rebm.errors import UserError
from rebm.eval.evaluation import EvalSpec, evaluate_model
from rebm.eval.fid import require_fid_ready
from rebm.eval.generation import check_seed_images
from rebm.eval.registry import standard_metrics
from rebm.eval.report import describe_evaluation
from rebm.methods.base import Method, StepContext, StepResult

LOGGER = logging.getLogger("rebm")


class TrainingDiverged(UserError, FloatingPointError):
    """A NaN/Inf loss; all ranks stop at the same step."""


def planned_last_step(cfg: TrainConfig, steps_per_epoch: int) -> float:
    """The step the run trains to: the first of max_steps and total_epochs (inf if neither)."""
    limits = []
    if cfg.max_steps is not None:
        limits.append(cfg.max_steps)
    if cfg.total_epochs is not None:
        limits.append(cfg.total_epochs * steps_per_epoch)
    return min(limits) if limits else math.inf


def train(cfg: TrainConfig, runtime: Runtime, make_method: Callable[[TrainConfig], Method]
          ) -> Dict[str, Any]:
    """Train with the method `make_method(cfg)` builds, in cfg.run_dir, held by this job (rank
    0 locks it) until the run ends. Every rank calls this."""
    started = time.perf_counter()
    cfg, lock = resolve_run_dir(cfg, runtime)
    try:
        return run(cfg, runtime, make_method(cfg), started)
    finally:
        if lock is not None:
            lock.release()


def resume_point(cfg: TrainConfig, runtime: Runtime, stage: int) -> Optional[dict]:
    """The state to resume from (rank 0 decides, every rank reads it), refused when it is of the
    other stage, or when the run it belongs to trained with another config (unless
    resume=force)."""
    state = agree_on_resume(runtime, cfg.run_dir, cfg.resume_from_state,
                            allow_auto=cfg.resume in ("auto", "force"))
    if state is not None:
        check_stage(state, stage)
    if state is None or cfg.resume == "force":
        return state
    changed = training_diff(state.get("config", {}), to_dict(cfg))
    if changed:
        raise ConfigError(
            f"'{state['_path']}' was trained with another config ({'; '.join(changed)}); to "
            f"continue it anyway pass resume=force, to start afresh choose another run_dir")
    return state


def run(cfg: TrainConfig, runtime: Runtime, method: Method, started: float) -> Dict[str, Any]:
    run_dir = cfg.run_dir
    plan = plan_batches(cfg, runtime.world_size, method.loss_streams)
    on_every_rank(runtime, lambda: setup_logging(runtime, run_dir), "create its log file")
    LOGGER.info("%s | run dir %s | world size %d | device %s | %d per device x %d accumulation",
                method.name, run_dir, runtime.world_size, runtime.device,
                plan.per_device_batch_size, plan.accumulation_steps)
    for key in ignored_fields_set(cfg):
        LOGGER.info("config field '%s' is accepted for compatibility but not used", key)
    if method.eval_samples and cfg.n_imgs_per_evaluation_log:
        # a missing FID or seed-image file (on any node) stops the run now, not after hours
        on_every_rank(runtime, lambda: (require_fid_ready(cfg), check_seed_images(cfg)),
                      "find the FID and seed-image files")

    # A resumed run takes its weights from the state, so model.ckpt_path is not read (the file
    # may have moved); the data position is the step, so the loader starts there directly.
    state = resume_point(cfg, runtime, method.stage)
    data = build_train_data(cfg, runtime, plan, start_step=int(state["step"]) if state else 0)
    last_step = planned_last_step(cfg, data.steps_per_epoch)
    parts = build_parts(cfg, runtime, method, last_step, load_pretrained=state is None)
    if state is not None:
        parts.load_state_dict(state, runtime)
    tracker = Tracker(cfg, runtime, run_dir, wandb_run_id=parts.progress.wandb_run_id,
                      echo=method.print_metrics)
    parts.progress.wandb_run_id = tracker.wandb_run_id
    tracker.truncate_metrics_after(parts.progress.step)  # records of an attempt that saved none
    LOGGER.info("%s | data: %s | training to step %s", method.describe(), data.describe(),
                last_step)
    ctx = parts.context(cfg, plan)
    with PreemptionFlag() as preemption:
        try:
            if parts.progress.eval_pending:  # an evaluation a preemption interrupted
                evaluate_and_keep_best(parts, cfg, plan, runtime, tracker,
                                       data.epoch_of(parts.progress.step - 1))
            outcome = run_steps(parts, ctx, data, cfg, plan, runtime, tracker, preemption,
                                last_step, started)
            if outcome is None:
                return finish(parts, cfg, plan, runtime, tracker,
                              data.epoch_of(parts.progress.step - 1))
        except Preempted:  # every rank agreed inside an evaluation: abandon it, save, exit
            parts.progress.eval_pending = True
        return stop_preempted(parts, cfg, runtime, tracker, preemption)


def run_steps(parts: Parts, ctx: StepContext, data, cfg: TrainConfig, plan: BatchPlan,
              runtime: Runtime, tracker: Tracker, preemption: PreemptionFlag, last_step: float,
              started: Optional[float]) -> Optional[str]:
    """Train to `last_step`; "preempted" when every rank agreed to stop before it, else None."""
    bar = progress_bar(runtime, parts.progress.step, last_step, cfg.batch_size)
    batches = iter(data)
    parts.progress.window.started = time.perf_counter()  # images/s counts training only
    # A collective timeout anywhere in the loop is reported with the rank(s) that did not arrive.
    with name_stuck_ranks(runtime, lambda: parts.progress.step + 1), bar:
        while parts.progress.step < last_step:
            micro_batches = next(batches)
            if started is not None:  # start-up cost: O(1) in the resumed step, no batch replay
                LOGGER.info("first batch after %.2fs", time.perf_counter() - started)
                started = None
            log_now = (plan.crossed(cfg.n_imgs_per_metrics_log, parts.progress.step + 1)
                       or (parts.method.log_final_step and parts.progress.step + 1 == last_step))
            result = train_one_step(parts, ctx, micro_batches, runtime, log_now)
            compile_cache.after_step()  # model.compile: keep new compiled code in the run dir
            step = parts.progress.step
            bar.update(loss=float(result.loss), lr=result.stats["learning_rate"],
                       epoch=data.epoch_of(step - 1), **parts.method.progress())
            if parts.progress.steps_run == 0:  # start-up is over: a missing rank surfaces fast
                set_collective_timeout(runtime, cfg.ddp_step_timeout_s)
            parts.progress.steps_run += 1
            decision = consensus(runtime, preempt=preemption.raised,
                                 nonfinite=not (result.finite and parts.precision.update_finite))
            if decision["nonfinite"]:
                raise TrainingDiverged(
                    f"non-finite loss or gradients at step {step} on at least one rank (the "
                    f"update was not applied); the newest state in {cfg.run_dir}/checkpoints is "
                    "from before it (try a lower lr)")
            at_intervals(parts, result, cfg, plan, runtime, tracker, data.epoch_of(step - 1),
                         log_now, last_step)
            if decision["preempt"] and step < last_step:  # at the last step: just finish
                return "preempted"
    return None


def stop_preempted(parts: Parts, cfg: TrainConfig, runtime: Runtime, tracker: Tracker,
                   preemption: PreemptionFlag) -> Dict[str, Any]:
    """Save the state (with the abandoned evaluation marked pending) and say how to resume."""
    save_training_state(parts, cfg, runtime, tracker)
    step = parts.progress.step
    pending = " (the interrupted evaluation runs first)" if parts.progress.eval_pending else ""
    LOGGER.log(logging.WARNING if runtime.is_main else logging.INFO,
               "stopped by %s: state saved at step %d; run the same command with "
               "run_dir=%s to resume%s", preemption.signal_name or "a signal on another rank",
               step, cfg.run_dir, pending)
    tracker.close()
    return {"step": step, "preempted": True}


def train_one_step(parts: Parts, ctx: StepContext, micro_batches, runtime: Runtime,
                   log_now: bool) -> StepResult:
    """One optimizer step: the method's update, then LR schedule, BatchNorm sync, EMA and the
    method's global statistics (e.g. DAT's curriculum)."""
    learning_rate = parts.optimizer.param_groups[0]["lr"]  # the LR this step uses
    result = parts.method.step(ctx, micro_batches, log_now)
    if parts.scheduler is not None:
        parts.scheduler.step()
    if parts.live_unsynced_batchnorm:
        # per-rank batch statistics would make the replicas (and their EMA) drift apart
        broadcast_buffers(runtime, parts.raw_model)
    if parts.ema is not None:
        parts.ema.update()
    parts.progress.step += 1
    result.stats = {**parts.method.after_step(runtime, result), "learning_rate": learning_rate}
    parts.progress.window.add(result.window)
    add_data_counts(parts.progress.window, micro_batches)  # e.g. unreadable images replaced
    return result


def at_intervals(parts: Parts, result: StepResult, cfg: TrainConfig, plan: BatchPlan,
                 runtime: Runtime, tracker: Tracker, epoch: int, log_now: bool,
                 last_step: float) -> None:
    """Metrics, image grids, evaluation and checkpoints, each every so many images. Every rank
    calls this: the intervals depend only on the step, so all ranks reach the same collectives."""
    step = parts.progress.step
    if log_now:
        log_metrics(parts, result, plan, runtime, tracker, epoch)
    if plan.crossed(cfg.n_imgs_per_image_log, step) and result.x_adv is not None:
        tracker.save_grid(result.x_adv, f"train_adv_step{step:08d}.png", step)
    if plan.crossed(cfg.n_imgs_per_evaluation_log, step):
        evaluate_and_keep_best(parts, cfg, plan, runtime, tracker, epoch)
    if plan.crossed(cfg.n_imgs_per_ckpt_save, step) and step < last_step:
        save_training_state(parts, cfg, runtime, tracker)


def log_metrics(parts: Parts, result: StepResult, plan: BatchPlan, runtime: Runtime,
                tracker: Tracker, epoch: int) -> None:
    """The window's global means (one all-reduce), this step's statistics, throughput."""
    window = parts.progress.window
    elapsed = time.perf_counter() - window.started
    totals = window.global_sums(runtime)
    data_counts = pop_data_counts(totals)
    summary = {**parts.method.summarize(totals), **data_counts, **result.stats,
               "imgs_per_s": window.steps * plan.global_batch_size / max(elapsed, 1e-9),
               **peak_memory(runtime),
               "replicas_identical": replicas_identical(runtime, *parts.replicated)}
    tracker.log(parts.progress.step, plan.images(parts.progress.step), epoch, summary)
    parts.progress.window = MetricsWindow()


def evaluate_and_keep_best(parts: Parts, cfg: TrainConfig, plan: BatchPlan, runtime: Runtime,
                           tracker: Tracker, epoch: int) -> Dict[str, Any]:
    """Every rank evaluates its shard; rank 0 records and keeps the best models."""
    step = parts.progress.step
    LOGGER.info("evaluating at step %d", step)
    with patient_collectives(runtime, cfg, parts):
        spec = EvalSpec(standard_metrics(cfg, samples=parts.method.eval_samples),
                        plan.eval_batch_size, tracker.run_dir, step)
        results = evaluate_model(parts.eval_model, cfg, runtime, spec)
    parts.progress.last_eval, parts.progress.last_eval_step = results, step
    parts.progress.eval_pending = False
    tracker.log(step, plan.images(step), epoch, results)
    LOGGER.info("evaluation at step %d: %s", step, describe_evaluation(results))
    tracker.log_table("eval/table", step, results)
    tracker.log_image(os.path.join(tracker.run_dir, "samples", f"samples_step{step:08d}.png"),
                      step)
    if not parts.method.keep_best:
        return results
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
            path = os.path.join(tracker.run_dir, filename)
            on_main(runtime, lambda p=path: save_model(parts.eval_model, p), f"write {path}")
    return results


def finish(parts: Parts, cfg: TrainConfig, plan: BatchPlan, runtime: Runtime, tracker: Tracker,
           epoch: int) -> Dict[str, Any]:
    """The final evaluation (unless the last step just ran one), model_final.pth, the state."""
    final_step = parts.progress.step
    final_path = os.path.join(tracker.run_dir, "model_final.pth")
    finished = decide_on_main(runtime, lambda: os.path.exists(final_path))
    if parts.progress.steps_run == 0 and finished:  # a rerun: its final files exist already
        LOGGER.info("nothing to do: the run is already at step %d (raise max_steps or "
                    "total_epochs to continue it)", final_step)
        tracker.close()
        return {"step": final_step}
    results = parts.progress.last_eval
    if cfg.n_imgs_per_evaluation_log and parts.progress.last_eval_step != final_step:
        results = evaluate_and_keep_best(parts, cfg, plan, runtime, tracker, epoch)
    # model_final first: once the final state exists, a rerun has nothing left to do
    # a plain state dict: it loads as model.ckpt_path of the next stage
    on_main(runtime, lambda: save_model(parts.eval_model, final_path), f"write {final_path}")
    LOGGER.info("wrote %s", final_path)
    save_training_state(parts, cfg, runtime, tracker)
    tracker.close()
    LOGGER.info("finished at step %d%s", final_step,
                f": {describe_evaluation(results)}" if results else "")
    LOGGER.info("files in %s: model_final.pth (evaluated weights), metrics.jsonl, samples/, "
                "checkpoints/ (training states; the same command continues the run), logs/",
                tracker.run_dir)
    return {"step": final_step}


def save_training_state(parts: Parts, cfg: TrainConfig, runtime: Runtime,
                        tracker: Tracker) -> None:
    """Rank 0 writes the state, every rank learns whether that worked (`save_on_main`); a state
    with non-finite weights is never written."""
    weights = [p.detach() for m in parts.replicated for p in m.parameters()]
    finite = bool(torch.isfinite(torch.nn.utils.get_total_norm(weights)))
    if consensus(runtime, nonfinite=not finite)["nonfinite"]:
        raise TrainingDiverged(
            f"the weights became non-finite by step {parts.progress.step}; not saving them (the "
            f"newest state in {cfg.run_dir}/checkpoints is from before; try a lower lr)")
    window_sums = parts.progress.window.global_sums(runtime)  # every rank: an all-reduce
    with patient_collectives(runtime, cfg, parts):
        save_on_main(runtime, lambda: parts.state_dict(cfg, runtime.world_size, window_sums),
                     tracker.run_dir, cfg.keep_last_states)


@contextmanager
def patient_collectives(runtime: Runtime, cfg: TrainConfig, parts: Parts) -> Iterator[None]:
    """The start-up collective timeout for a save or an evaluation (rank 0 writing ~0.5 GB, a
    50k-sample FID), the shorter step timeout again after it."""
    if parts.progress.steps_run == 0:  # still the start-up timeout
        yield
        return
    set_collective_timeout(runtime, max(cfg.ddp_timeout_s, cfg.ddp_step_timeout_s))
    try:
        yield
    finally:
        set_collective_timeout(runtime, cfg.ddp_step_timeout_s)
