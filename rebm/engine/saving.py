"""What a run writes besides its metrics: training states and the best models, each with every
rank agreeing on the outcome (docs/design.md §3, "Outputs")."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Dict, Iterator

from rebm.checkpoint.state import check_weights_all_ranks, save_state_all_ranks, training_state
from rebm.checkpoint.weights import save_model
from rebm.config import TrainConfig
from rebm.distributed.collectives import on_main, set_collective_timeout
from rebm.distributed.runtime import Runtime
from rebm.engine.parts import Parts, Progress
from rebm.errors import UserError


class TrainingDiverged(UserError, FloatingPointError):
    """A NaN/Inf loss; all ranks stop at the same step."""


class ReplicasDiffer(UserError, RuntimeError):
    """The ranks' weights are no longer bit-identical; all ranks stop before a save."""


def save_training_state_all_ranks(parts: Parts, cfg: TrainConfig, runtime: Runtime) -> None:
    """Rank 0 writes the state of every part into cfg.run_dir, every rank learns whether that
    worked (`save_state_all_ranks`). A state is written only when the weights are finite and
    every rank holds the same ones (one all-reduce checks both: docs/design.md §7)."""
    step = parts.progress.step
    finite, identical = check_weights_all_ranks(runtime, *parts.replicated)
    if not finite:
        raise TrainingDiverged(
            f"the weights became non-finite by step {step}; not saving them (the newest state "
            f"in {cfg.run_dir}/checkpoints is from before; try a lower lr)")
    if not identical:
        raise ReplicasDiffer(
            f"the ranks' weights differ at step {step}; not saving them (the newest state in "
            f"{cfg.run_dir}/checkpoints is from before: the same command resumes from it)")
    parts.progress.window.gather_all_ranks(runtime)  # an all-reduce; rank 0 saves the sums
    with patient_collectives(runtime, cfg, parts.progress):
        save_state_all_ranks(runtime, lambda: training_state(
            parts.stateful(), parts.method.stage, step, cfg, runtime.world_size),
            cfg.run_dir, cfg.keep_last_states)


def keep_best_all_ranks(parts: Parts, cfg: TrainConfig, runtime: Runtime, results: Dict[str, Any]
              ) -> None:
    """model_bestacc.pth (robust accuracy, clean without robust_eval) and model_bestfid.pth,
    written by rank 0 when an evaluation beats the best so far."""
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
            path = os.path.join(cfg.run_dir, filename)
            on_main(runtime, lambda p=path: save_model(parts.eval_model, p), f"write {path}")


@contextmanager
def patient_collectives(runtime: Runtime, cfg: TrainConfig, progress: Progress
                        ) -> Iterator[None]:
    """The start-up collective timeout for a save or an evaluation (rank 0 writing ~0.5 GB, a
    50k-sample FID), the shorter step timeout again after it."""
    if progress.steps_run == 0:  # still the start-up timeout
        yield
        return
    set_collective_timeout(runtime, max(cfg.ddp_timeout_s, cfg.ddp_step_timeout_s))
    try:
        yield
    finally:
        set_collective_timeout(runtime, cfg.ddp_step_timeout_s)
