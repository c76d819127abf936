"""What a run writes besides its metrics: training states and the best models, each with every
rank agreeing on the outcome (docs/design.md §3, "Outputs")."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Dict, Iterator

import torch

from rebm.checkpoint.state import save_on_main, training_state
from rebm.checkpoint.weights import save_model
from rebm.config import TrainConfig
from rebm.distributed.collectives import consensus, on_main, set_collective_timeout
from rebm.distributed.runtime import Runtime
from rebm.engine.parts import Parts, Progress
from rebm.errors import UserError


class TrainingDiverged(UserError, FloatingPointError):
    """A NaN/Inf loss; all ranks stop at the same step."""


def save_training_state(parts: Parts, cfg: TrainConfig, runtime: Runtime) -> None:
    """Rank 0 writes the state of every part into cfg.run_dir, every rank learns whether that
    worked (`save_on_main`); a state with non-finite weights is never written."""
    weights = [p.detach() for m in parts.replicated for p in m.parameters()]
    finite = bool(torch.isfinite(torch.nn.utils.get_total_norm(weights)))
    if consensus(runtime, nonfinite=not finite)["nonfinite"]:
        raise TrainingDiverged(
            f"the weights became non-finite by step {parts.progress.step}; not saving them (the "
            f"newest state in {cfg.run_dir}/checkpoints is from before; try a lower lr)")
    parts.progress.window.gather(runtime)  # every rank: an all-reduce; rank 0 saves the sums
    with patient_collectives(runtime, cfg, parts.progress):
        save_on_main(runtime, lambda: training_state(
            parts.stateful(), parts.method.stage, parts.progress.step, cfg, runtime.world_size),
            cfg.run_dir, cfg.keep_last_states)


def keep_best(parts: Parts, cfg: TrainConfig, runtime: Runtime, results: Dict[str, Any]
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
