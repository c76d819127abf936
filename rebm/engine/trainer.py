"""The one training loop, for every stage: `Trainer(cfg, runtime, make_training_method).fit()`.

The Trainer builds and owns what a run is made of — config, batch plan, runtime (with the
preemption flag), run tracking, the parts (model, optimizer, EMA, method, ...) and the data — and
`fit` reads like a training loop: step, agree, log, evaluate, save, stop. It owns the optimizer
step (`train_step_all_ranks`, with the update of rebm.engine.step); the method (rebm.methods)
computes its losses. Processes, data positions and checkpoint files are handled by
rebm.distributed, rebm.data and rebm.checkpoint. Every rank runs every line: intervals depend only
on the step, decisions go through one consensus per step, and rank 0's writes sit behind inert
objects (Tracker) or `on_main`. A method whose name ends in `_all_ranks` reaches a collective:
every rank calls it, at the same point (docs/design.md §3).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Callable, Dict, Optional

from rebm.checkpoint.manager import CheckpointManager
from rebm.checkpoint.run_directory import RunDirectory, resolve_run_dir_all_ranks
from rebm.checkpoint.state import check_stage
from rebm.config import (
    ConfigError,
    TrainConfig,
    explicit_keys,
    ignored_fields_notice,
    plan_batches,
    replace,
    to_dict,
    training_diff,
)
from rebm.config.sections import RunSection, ScheduleSection
from rebm.data import build_train_data
from rebm.distributed.collectives import (
    broadcast_buffers,
    consensus,
    name_stuck_ranks,
    on_every_rank,
    set_collective_timeout,
)
from rebm.distributed.logs import setup_logging
from rebm.distributed.runtime import Runtime
from rebm.distributed.signals import Preempted, PreemptionFlag
from rebm.engine.events import EventSchedule
from rebm.engine.metrics_window import (
    MetricsWindow,
    add_data_counts,
    peak_memory_mib,
    pop_data_counts,
)
from rebm.engine.parts import Parts, Progress, build_parts_all_ranks, state_fit_check
from rebm.engine.run_files import check_run_inputs_all_ranks
from rebm.engine.saving import (
    TrainingDiverged,
    patient_collectives,
    save_training_state_all_ranks,
)
from rebm.engine.step import update_all_ranks
from rebm.engine.tracking import ProgressLines, Tracker, progress_bar, progress_lines
from rebm.eval.evaluator import Evaluator
from rebm.eval.registry import standard_metrics
from rebm.eval.results import describe_evaluation
from rebm.methods.base import Method, StepResult

LOGGER = logging.getLogger("rebm")
MethodFactory = Callable[[TrainConfig], Method]


def train(cfg: TrainConfig, runtime: Runtime,
          make_training_method: MethodFactory) -> Dict[str, Any]:
    """Train with the training method `make_training_method(cfg)` builds, in cfg.run.run_dir, held
    by this job (rank 0 locks it) until the run ends. Every rank calls this."""
    started = time.perf_counter()
    # the inputs first: every missing file is named at once, before anything is written
    check_run_inputs_all_ranks(runtime, cfg.evaluation, cfg.run,
                               evaluates=bool(cfg.intervals.n_imgs_per_evaluation_log),
                               training_method=make_training_method(cfg))
    run_directory, lock = resolve_run_dir_all_ranks(cfg.run.run_dir, to_dict(cfg), runtime)
    cfg = replace(cfg, run_dir=run_directory.path)
    try:
        return Trainer(cfg, runtime, make_training_method, started).fit()
    finally:
        if lock is not None:
            lock.release()


def planned_last_step(schedule: ScheduleSection, steps_per_epoch: int) -> float:
    """The step the run trains to: the first of max_steps and total_epochs (inf if neither)."""
    limits = []
    if schedule.max_steps is not None:
        limits.append(schedule.max_steps)
    if schedule.total_epochs is not None:
        limits.append(schedule.total_epochs * steps_per_epoch)
    return min(limits) if limits else math.inf


def finished_line(schedule: ScheduleSection, steps_per_epoch: int, step: int) -> str:
    """The line of a rerun with nothing left to train: which limit ends the run, and the one to
    raise (a run stops at the first of max_steps and total_epochs it reaches)."""
    limits = {}
    if schedule.max_steps is not None:
        limits["max_steps"] = (schedule.max_steps, f"max_steps: {schedule.max_steps}")
    if schedule.total_epochs is not None:
        limits["total_epochs"] = (schedule.total_epochs * steps_per_epoch,
                                  f"total_epochs: {schedule.total_epochs} ({steps_per_epoch} "
                                  "steps an epoch)")
    if not limits:  # a run without either limit never finishes; said for completeness
        return f"nothing to do: the run is already at step {step}"
    end = min(last for last, _ in limits.values())
    binding = [key for key, (last, _) in limits.items() if last == end]
    other = [f"; {text} ends it later" for key, (last, text) in limits.items() if last > end]
    where = "where" if step == end else f"past step {end}, where"
    return (f"nothing to do: the run is already at step {step}, {where} "
            f"{' and '.join(limits[key][1] for key in binding)} "
            f"{'ends' if len(binding) == 1 else 'end'} it{''.join(other)}; raise "
            f"{' and '.join(binding)} to continue it")


def resume_point_all_ranks(run: RunSection, config: Dict[str, Any],
                           checkpoint_manager: CheckpointManager, stage: int,
                           fits: Optional[Callable[[dict], None]] = None) -> Optional[dict]:
    """The state to resume from (rank 0 decides, every rank reads it), refused when it is of the
    other stage, or when the run it belongs to trained with another config than `config` (the
    run's, as to_dict gives it) unless resume=force. `fits`: a state that fails it is passed
    over for the previous one (`CheckpointManager.find_resumable`)."""
    state = checkpoint_manager.resume_state_all_ranks(run.resume_from_state,
                                                      allow_auto=run.resume in ("auto", "force"),
                                                      fits=fits)
    if state is not None:
        check_stage(state, stage)
    if state is None or run.resume == "force":
        return state
    changed = training_diff(state.get("config", {}), config)
    if changed:
        raise ConfigError(
            f"'{state['_path']}' was trained with another config ({'; '.join(changed)}); to "
            f"continue it anyway pass resume=force, to start afresh choose another run_dir")
    return state


class Trainer:
    """One training run in cfg.run.run_dir (already resolved and held by this job). It builds its
    parts from the config's sections and keeps the sections its loop reads."""

    def __init__(self, cfg: TrainConfig, runtime: Runtime, make_training_method: MethodFactory,
                 started: Optional[float] = None):
        self.schedule, self.intervals = cfg.schedule, cfg.intervals
        self.distributed, self.evaluation = cfg.distributed, cfg.evaluation
        self.config = to_dict(cfg)  # what every state keeps and a resume compares
        # a preempted run's hint names the run_dir the user chose, as the command set it
        self.run_dir_chosen = "run_dir" in explicit_keys(cfg)
        self.started = started  # for the start-up time logged at the first batch
        self.preemption = PreemptionFlag()  # installed while `fit` runs
        self.runtime = dataclasses.replace(runtime, preemption=self.preemption)
        self.run_directory = RunDirectory(cfg.run.run_dir)  # every path in it; nothing else builds one
        self.checkpoint_manager = CheckpointManager(self.run_directory, self.runtime,
                                                    cfg.run.keep_last_states, cfg.intervals.n_imgs_per_ckpt_save)
        training_method = make_training_method(cfg)
        self.plan = plan_batches(cfg.schedule, cfg.eval, runtime.world_size, training_method.loss_streams(cfg.method))
        self._start_logging_all_ranks(training_method, ignored_fields_notice(cfg))
        self.evaluator = Evaluator(cfg.evaluation, self.runtime,
                                   standard_metrics(cfg.evaluation, training_method.eval_samples),
                                   batch_size=self.plan.eval_batch_size, run_dir=cfg.run.run_dir)
        if cfg.intervals.n_imgs_per_evaluation_log:
            # a missing FID, seed-image or other metric file (on any node) stops the run now,
            # not after hours
            self.evaluator.start_all_ranks()
        # A resumed run takes its weights from the state, so model.ckpt_path is not read (the
        # file may have moved); the data position is the step, so the loader starts there.
        state = resume_point_all_ranks(cfg.run, self.config, self.checkpoint_manager,
                                       training_method.stage,
                                       fits=state_fit_check(cfg.model, cfg.data,
                                                            cfg.optimization, cfg.ema,
                                                            training_method.stage))
        self.data = build_train_data(cfg.inputs, self.runtime, self.plan, training_method.streams,
                                     start_step=int(state["step"]) if state else 0)
        self.last_step = planned_last_step(self.schedule, self.data.steps_per_epoch)
        self.events = EventSchedule(self.plan, self.intervals,
                                    at_step_start=training_method.events_at_step_start,
                                    last_step=self.last_step,
                                    log_final_step=training_method.log_final_step)
        self.resumed = state is not None
        self.parts: Parts = build_parts_all_ranks(cfg, self.runtime, training_method,
                                                  self.last_step, load_pretrained=state is None)
        if state is not None:
            self.parts.load_state_all_ranks(state, self.runtime)
        identity = self.parts.identity
        self.tracker = Tracker(cfg.logging, self.runtime, self.run_directory, self.config,
                               last_step=self.last_step).start_all_ranks(identity.wandb_run_id)
        identity.wandb_run_id = self.tracker.wandb_run_id
        # records newer than the state (or, starting afresh, every record: the starting model's
        # evaluation at step 0 too) are an attempt's that saved no state after them
        self.tracker.truncate_metrics_after_all_ranks(self.progress.step if state else -1)
        LOGGER.info("%s | data: %s | training to step %s", training_method.describe(),
                    self.data.describe(), self.last_step)

    @property
    def progress(self) -> Progress:
        return self.parts.progress

    def _start_logging_all_ranks(self, training_method: Method, notice: Optional[str]) -> None:
        """Every rank's log file, then the run's first lines (and `notice`, if any)."""
        runtime, plan = self.runtime, self.plan
        on_every_rank(runtime,
                      lambda: setup_logging(runtime, self.run_directory.log_file(runtime.rank)),
                      "create its log file")
        LOGGER.info("%s | run dir %s | world size %d | device %s | %d per device x %d "
                    "accumulation", training_method.name, self.run_directory.path,
                    runtime.world_size, runtime.device, plan.per_device_batch_size,
                    plan.accumulation_steps)
        if notice:
            LOGGER.info(notice)

    def fit(self) -> Dict[str, Any]:
        """Train to the last step: step, agree on stopping, log, evaluate, save, at the times
        `self.events` gives; then the final evaluation and files. A preemption saves and returns
        early."""
        events, progress = self.events, self.progress
        with self.preemption:
            try:
                batches = iter(self.data)
                bar = progress_bar(self.runtime, progress.step, self.last_step,
                                   self.schedule.batch_size, self.timed_progress_lines())
                # a collective timeout in the loop names the rank(s) that did not arrive
                with name_stuck_ranks(self.runtime, lambda: progress.step + 1,
                                      lambda: progress.steps_run > 0), bar:
                    # the starting model (a fresh run), or an evaluation a preemption abandoned
                    # (at the last step, the final one: finish_all_ranks runs it)
                    if progress.step < self.last_step and (
                            progress.eval_pending
                            or (not self.resumed and events.evaluation_due(progress.step))):
                        self.evaluate_all_ranks()
                    progress.window.started = time.perf_counter()  # images/s: training only
                    while progress.step < self.last_step:
                        log_now = events.log_due(progress.step + 1)
                        result = self.train_step_all_ranks(next(batches), log_now)
                        decision = consensus(self.runtime, preempt=self.preemption.raised,
                                             nonfinite=not (result.applied and result.finite),
                                             write_failed=self.tracker.write_failed)
                        if decision["nonfinite"]:
                            self.diverged(result)
                        if decision["write_failed"]:  # the previous metrics log's record
                            self.tracker.raise_write_failure()
                        bar.update(loss=float(result.loss), lr=result.stats["learning_rate"],
                                   epoch=self.epoch, **self.parts.training_method.progress())
                        if log_now:
                            self.log_all_ranks(result)
                        if events.previews_due(progress.step):
                            self.save_previews_all_ranks(result)
                        # at the last step: just finish
                        stopping = decision["preempt"] and progress.step < self.last_step
                        if events.evaluation_due(progress.step):
                            if stopping:  # the resumed run evaluates first
                                progress.eval_pending = True
                            else:
                                self.evaluate_all_ranks()
                        if stopping:
                            break  # stop_preempted_all_ranks saves this step's state
                        if self.checkpoint_manager.save_due(self.plan, progress.step,
                                                            self.last_step):
                            self.save_all_ranks()
                if progress.step < self.last_step:  # every rank agreed to stop
                    return self.stop_preempted_all_ranks()
                return self.finish_all_ranks()
            except Preempted:  # every rank agreed inside an evaluation: abandon it, save, exit
                progress.eval_pending = True
                return self.stop_preempted_all_ranks()

    def timed_progress_lines(self) -> Optional[ProgressLines]:
        """Rank 0's progress lines at `progress_interval_s` when the console has no bar, with
        when the next metrics log, evaluation and state save come (looked for within the
        longest of their intervals)."""
        intervals = (self.intervals.n_imgs_per_metrics_log,
                     self.intervals.n_imgs_per_evaluation_log, self.checkpoint_manager.interval_imgs)
        horizon = max(-(-(i or 0) // self.plan.global_batch_size) for i in intervals) + 2
        return progress_lines(
            self.tracker.logging, self.runtime, last_step=self.last_step,
            global_batch_size=self.plan.global_batch_size,
            current_step=lambda: self.progress.step, horizon=horizon,
            events={"metrics log": self.events.log_due,
                    "evaluation": self.events.evaluation_due,
                    "state save": lambda step: self.checkpoint_manager.save_due(
                        self.plan, step, self.last_step)})

    @property
    def epoch(self) -> int:
        """The epoch of the newest step done (0 before the first)."""
        return self.data.epoch_of(max(self.progress.step - 1, 0))

    def log_due(self, step: int) -> bool:
        """Training metrics are logged after optimizer step `step` (counted from 1)."""
        return self.events.log_due(step)

    def train_step_all_ranks(self, micro_batches, log_now: bool) -> StepResult:
        """One optimizer step: the update (zero_grad, the method's losses and their backward
        under no_sync, clipping, the optimizer step: rebm.engine.step), then, if and only if
        it was applied, the LR schedule, BatchNorm sync, EMA, the step counter, the method's
        global statistics (e.g. DAT's curriculum) and the metrics window. Every rank calls
        this; `result.applied` is the same on every rank (DDP all-reduced the gradients)."""
        if self.started is not None:  # start-up cost: O(1) in the resumed step, no replay
            LOGGER.info("first batch after %.2fs", time.perf_counter() - self.started)
            self.started = None
        parts, progress = self.parts, self.progress
        learning_rate = parts.optimizer.param_groups[0]["lr"]  # the LR this step uses
        result = update_all_ranks(parts, self.plan, micro_batches, log_now=log_now)
        if result.applied:
            if parts.scheduler is not None:
                parts.scheduler.step()
            if parts.live_unsynced_batchnorm:
                # per-rank batch statistics would make the replicas (and their EMA) drift apart
                broadcast_buffers(self.runtime, parts.raw_model)
            if parts.ema is not None:
                parts.ema.update()
            progress.step += 1
            result.stats = {**parts.training_method.after_step_all_ranks(self.runtime, result),
                            "learning_rate": learning_rate}
            if result.grad_norm is not None:
                result.stats["grad_norm"] = result.grad_norm
            progress.window.add(result.window)
            add_data_counts(progress.window, micro_batches)  # e.g. unreadable images replaced
        if parts.compile_cache is not None:
            parts.compile_cache.after_step()  # model.compile: keep new compiled code in run dir
        if progress.steps_run == 0:  # start-up is over: a missing rank surfaces fast
            kept = set_collective_timeout(self.runtime, self.distributed.ddp_step_timeout_s)
            if kept and self.runtime.is_main:  # the same on every rank: one line per job
                LOGGER.warning(kept)
        progress.steps_run += 1
        return result

    def diverged(self, result: StepResult) -> None:
        """Stop on a non-finite loss or update on any rank (every rank, at the same step)."""
        step = self.progress.step if result.applied else self.progress.step + 1
        skipped = "" if result.applied else " (the update was not applied)"
        raise TrainingDiverged(
            f"non-finite loss or gradients at step {step} on at least one rank{skipped}; the "
            f"newest state in {self.run_directory.states_dir} is from before it (try a lower lr)")

    def log_all_ranks(self, result: StepResult) -> None:
        """The window's global means and the ranks' peak memory (one all-reduce), this step's
        statistics, throughput; rank 0 writes the record (its failure rides on the next
        consensus: `Tracker.log_training`)."""
        window, runtime = self.progress.window, self.runtime
        elapsed = time.perf_counter() - window.started
        totals, peaks = window.global_sums_all_ranks(runtime, peak_memory_mib(runtime))
        data_counts = pop_data_counts(totals)
        summary = {**self.parts.training_method.summarize(totals), **data_counts, **result.stats,
                   "imgs_per_s": window.steps * self.plan.global_batch_size / max(elapsed, 1e-9),
                   **peaks}
        step = self.progress.step
        self.tracker.log_training(step, self.plan.images(step), self.epoch, summary)
        self.progress.window = MetricsWindow()

    def save_previews_all_ranks(self, result: StepResult) -> None:
        """The image grids the method asked for (e.g. DAT's negatives)."""
        for name, images in result.previews.items():
            self.tracker.save_grid_all_ranks(images, f"{name}_step{self.progress.step:08d}.png",
                                   self.progress.step)

    def evaluate_all_ranks(self, candidate: bool = True) -> Dict[str, Any]:
        """Every rank evaluates its shard; rank 0 records it and, when this evaluation is a
        `candidate`, keeps the best models."""
        progress, step = self.progress, self.progress.step
        LOGGER.info("evaluating at step %d", step)
        with patient_collectives(self.runtime, self.distributed, progress):
            eval_results = self.evaluator.evaluate_all_ranks(self.parts.eval_model, step)
        results = eval_results.values
        progress.last_eval, progress.last_eval_step = results, step
        progress.eval_pending = False
        self.tracker.log_all_ranks(step, self.plan.images(step), self.epoch, results)
        LOGGER.info("evaluation at step %d: %s", step, describe_evaluation(results))
        self.tracker.log_table_all_ranks("eval/table", step, results)
        if "sample_grid" in eval_results.files:  # the same on every rank
            self.tracker.log_image_all_ranks(eval_results.files["sample_grid"], step)
        if candidate and self.parts.training_method.keep_best:
            self.checkpoint_manager.keep_best_all_ranks(self.parts.eval_model, progress.best,
                                                        results,
                                                        robust_eval=self.evaluation.eval.robust_eval)
        return results

    def save_all_ranks(self) -> None:
        """The training state of this step (rank 0 writes; every rank learns the outcome)."""
        save_training_state_all_ranks(self.parts, self.checkpoint_manager, self.config,
                                      self.distributed, self.runtime)

    def check_records_all_ranks(self) -> None:
        """Stop every rank if rank 0 could not write the last metrics log's record (the loop's
        consensus checks the earlier ones)."""
        if consensus(self.runtime, write_failed=self.tracker.write_failed)["write_failed"]:
            self.tracker.raise_write_failure()

    def stop_preempted_all_ranks(self) -> Dict[str, Any]:
        """Save the state (with an abandoned evaluation marked pending), say how to resume."""
        self.check_records_all_ranks()
        self.save_all_ranks()
        step = self.progress.step
        pending = " (the interrupted evaluation runs first)" if self.progress.eval_pending else ""
        # The plain command finds its default run_dir again; a run_dir the user chose is named,
        # as the command that set it (file or command line) does.
        where = f" with run_dir={self.run_directory.path}" if self.run_dir_chosen else ""
        LOGGER.log(logging.WARNING if self.runtime.is_main else logging.INFO,
                   "stopped by %s: state saved at step %d; run the same command%s to resume%s",
                   self.preemption.signal_name or "a signal on another rank", step, where,
                   pending)
        self.tracker.close_all_ranks()
        return {"step": step, "preempted": True}

    def finish_all_ranks(self) -> Dict[str, Any]:
        """The final evaluation (unless the last step just ran one), model_final.pth, the
        state."""
        self.check_records_all_ranks()
        progress = self.progress
        finished = self.checkpoint_manager.finished_all_ranks()
        if progress.steps_run == 0 and finished:  # a rerun: its final files exist already
            LOGGER.info("%s", finished_line(self.schedule, self.data.steps_per_epoch,
                                            progress.step))
            self.tracker.close_all_ranks()
            return {"step": progress.step}
        results = progress.last_eval
        if self.intervals.n_imgs_per_evaluation_log and progress.last_eval_step != progress.step:
            # a report of the final model; the best models' candidate only where the loop
            # the method follows would have evaluated it (rebm.engine.events)
            results = self.evaluate_all_ranks(
                candidate=self.events.final_evaluation_is_candidate(progress.step))
        # model_final first: once the final state exists, a rerun has nothing left to do
        final_path = self.checkpoint_manager.save_final_all_ranks(self.parts.eval_model)
        LOGGER.info("wrote %s", final_path)
        self.save_all_ranks()
        self.tracker.close_all_ranks()
        LOGGER.info("finished at step %d%s", progress.step,
                    f": {describe_evaluation(results)}" if results else "")
        LOGGER.info("files in %s: %s", self.run_directory.path, self.run_directory.describe_files())
        return {"step": progress.step}
