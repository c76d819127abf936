"""Saving a training state with every rank agreeing on the outcome (docs/design.md §3,
"Outputs"): the checks before it, and the collectives' timeout around saves and evaluations.
Where states and models go: rebm.checkpoint (RunDirectory, CheckpointManager)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator

from rebm.checkpoint.manager import CheckpointManager
from rebm.checkpoint.state import check_weights_all_ranks, training_state
from rebm.config.sections import DistributedSection
from rebm.distributed.collectives import name_missing_ranks, set_collective_timeout
from rebm.distributed.runtime import Runtime
from rebm.engine.parts import Parts, Progress
from rebm.errors import UserError


class TrainingDiverged(UserError, FloatingPointError):
    """A NaN/Inf loss; all ranks stop at the same step."""


class ReplicasDiffer(UserError, RuntimeError):
    """The ranks' weights are no longer bit-identical; all ranks stop before a save."""


def save_training_state_all_ranks(parts: Parts, checkpoint_manager: CheckpointManager,
                                  config: Dict[str, Any], distributed: DistributedSection,
                                  runtime: Runtime) -> None:
    """Rank 0 writes the state of every part (and `config`, the run's as to_dict gives it) into
    the run's checkpoints/, every rank learns whether that worked
    (`CheckpointManager.save_state_all_ranks`). A state is written only when the weights are
    finite and every rank holds the same ones (one all-reduce checks both: docs/design.md §7)."""
    step = parts.progress.step
    finite, identical = check_weights_all_ranks(runtime, *parts.replicated)
    if not finite:
        raise TrainingDiverged(
            f"the weights became non-finite by step {step}; not saving them (the newest state "
            f"in {checkpoint_manager.run_directory.states_dir} is from before; try a lower lr)")
    if not identical:
        raise ReplicasDiffer(
            f"the ranks' weights differ at step {step}; not saving them (the newest state in "
            f"{checkpoint_manager.run_directory.states_dir} is from before: the same command "
            "resumes from it)")
    parts.progress.window.gather_all_ranks(runtime)  # an all-reduce; rank 0 saves the sums
    with patient_collectives(runtime, distributed, parts.progress, "the save of the training state"):
        checkpoint_manager.save_state_all_ranks(lambda: training_state(
            parts.stateful(), parts.training_method.stage, step, config, runtime.world_size))


@contextmanager
def patient_collectives(runtime: Runtime, distributed: DistributedSection, progress: Progress,
                        what: str = "the evaluation") -> Iterator[None]:
    """The start-up collective timeout for a save or an evaluation (rank 0 writing ~0.5 GB, a
    50k-sample FID), the shorter step timeout again after it. A rank that does not arrive in
    it is named in one line saying `what` stalled, at which step, and the timeout in force."""
    step = progress.step
    if progress.steps_run == 0:  # still the start-up timeout
        advice = (f"It waits ddp_timeout_s ({distributed.ddp_timeout_s:g} s) before the first "
                  "step of this process: raise ddp_timeout_s if it is legitimately slower.")
        with name_missing_ranks(runtime, lambda: f"in {what} at step {step}", advice):
            yield
        return
    patient = max(distributed.ddp_timeout_s, distributed.ddp_step_timeout_s)
    advice = (f"It waits {patient:g} s, the larger of ddp_timeout_s and ddp_step_timeout_s: "
              "raise ddp_timeout_s if it is legitimately slower.")
    set_collective_timeout(runtime, patient)
    try:
        with name_missing_ranks(runtime, lambda: f"in {what} at step {step}", advice):
            yield
    finally:
        set_collective_timeout(runtime, distributed.ddp_step_timeout_s)
