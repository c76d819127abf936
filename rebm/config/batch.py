"""The batch plan: the one place that turns the config's batch sizes into numbers per device.

`batch_size` is the GLOBAL number of images per optimizer step, whatever the world size
(docs/design.md §2). The plan carries everything derived from it — the micro-batch, the number of
accumulation micro-steps, the evaluation batch — and the rule for "did this step cross an
interval of N images"; nothing else re-derives them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rebm.config.errors import ConfigError
from rebm.config.evaluation import EvalConfig
from rebm.config.sections import ScheduleSection

# Evaluation without a training method (rebm.eval.evaluate, the robustness test) sizes its
# batches as three micro-batches, what the loss pass of the stage-2 models it mostly evaluates
# holds; a training run passes its method's own count (`Method.loss_streams`).
STANDALONE_EVAL_STREAMS = 3


@dataclass(frozen=True)
class BatchPlan:
    """How the global batch is split: batch_size = per_device * accumulation * world_size."""

    global_batch_size: int
    per_device_batch_size: int
    accumulation_steps: int
    world_size: int
    eval_batch_size: int  # evaluation images per rank and batch

    def crossed(self, interval_imgs: Optional[int], step: int) -> bool:
        """True when the global image counter passed a multiple of `interval_imgs` during
        optimizer step `step` (steps count from 1)."""
        if not interval_imgs:
            return False
        before = (step - 1) * self.global_batch_size
        return (step * self.global_batch_size) // interval_imgs > before // interval_imgs

    def images(self, step: int) -> int:
        """Images seen after `step` optimizer steps."""
        return step * self.global_batch_size


def eval_batch_size(schedule: ScheduleSection, evaluation: EvalConfig, world_size: int,
                    loss_streams: int = STANDALONE_EVAL_STREAMS) -> int:
    """Evaluation images per rank and batch: `per_device_eval_batch_size`, by default the global
    `batch_size` capped at `loss_streams` training micro-batches.

    Evaluation batches are independent of the world size where they can be: halving them with
    every doubling of ranks made 2-rank evaluation run twice as many half-size batches, which
    small models on CPU pay for in per-batch overhead. The cap keeps memory within what the
    training loss pass already holds. Lenient on purpose: evaluation runs on any world size."""
    if evaluation.per_device_eval_batch_size:
        return evaluation.per_device_eval_batch_size
    micro_batch = schedule.per_device_batch_size or max(1, schedule.batch_size // world_size)
    return min(schedule.batch_size, loss_streams * micro_batch)


def plan_batches(schedule: ScheduleSection, evaluation: EvalConfig, world_size: int,
                 loss_streams: int = STANDALONE_EVAL_STREAMS) -> BatchPlan:
    """The plan of a training run on `world_size` ranks whose method's loss pass holds
    `loss_streams` micro-batches (`Method.loss_streams(cfg.method)`: it sizes the evaluation batch);
    a batch size that does not divide is a ConfigError before anything starts."""
    if schedule.batch_size % world_size:
        raise ConfigError(
            f"batch_size {schedule.batch_size} is not divisible by the world size {world_size}; "
            f"choose a batch_size that is a multiple of {world_size}"
        )
    per_device = schedule.per_device_batch_size or schedule.batch_size // world_size
    if schedule.batch_size % (per_device * world_size):
        raise ConfigError(
            f"batch_size {schedule.batch_size} is not divisible by per_device_batch_size "
            f"{per_device} x world size {world_size}; choose per_device_batch_size dividing "
            f"{schedule.batch_size // world_size}"
        )
    return BatchPlan(
        global_batch_size=schedule.batch_size,
        per_device_batch_size=per_device,
        accumulation_steps=schedule.batch_size // (per_device * world_size),
        world_size=world_size,
        eval_batch_size=eval_batch_size(schedule, evaluation, world_size, loss_streams),
    )
