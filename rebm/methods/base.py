"""What a training method is: its input streams, the loss of one micro-batch and its metrics
(docs/design.md §6).

The engine (rebm.engine) owns the optimizer step and everything around it: data, processes,
zero_grad, backward (under no_sync), clipping, the optimizer and precision step, the scheduler,
EMA, intervals, evaluation, states (rebm.engine.step, rebm.engine.trainer). A method declares the
input streams it consumes (`streams`; the data pipeline loads those only, and `loss_streams`
sizes the evaluation batch and `--check`'s memory plan) and computes losses: `micro_loss` runs
the forward of one micro-batch and returns its loss and what it keeps; `step_result` turns the
micro-batches' outputs into a `StepResult`; `after_step_all_ranks` computes the global
statistics it needs once an update was applied (every rank calls it, collectives allowed);
`summarize` turns the metrics window into the numbers logged. No method calls backward, an
optimizer step or a precision step. Method state (e.g. DAT's curriculum) goes through
state_dict/load_state_dict, under its own key of the training state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from rebm.config import ModelConfig
from rebm.config.origins import BUILT_IN_CODE, ConfigOrigins
from rebm.config.sections import MethodSection, ScheduleSection
from rebm.data import MicroBatch, Stream
from rebm.distributed.runtime import Runtime


@dataclass(frozen=True)
class StepContext:
    """What a method's loss runs on; the engine builds it once per run."""

    model: nn.Module  # DDP / DataParallel / compiled wrapper: the loss forward (its backward is
    # the engine's, and all-reduces the gradients under DDP)
    attacked: nn.Module  # attack_view(model): without DDP, through DataParallel, compiled if it is
    autocast: Callable[[], ContextManager]  # the run's mixed precision for forwards
    scorer: nn.Module  # scoring_view(model): the no-grad score forwards, never compiled

    @property
    def device(self) -> torch.device:
        return next(self.attacked.parameters()).device


@dataclass
class StepResult:
    """What one optimizer step leaves behind on this rank (all tensors detached)."""

    loss: Tensor  # the total loss, mean over this rank's micro-batches
    losses: Dict[str, Tensor]  # each loss term, same mean (e.g. {"ebm_binary": ..., "clf": ...})
    window: Dict[str, float]  # sums this step adds to the metrics window (summed over ranks)
    # images the engine saves as grids every n_imgs_per_image_log, as <name>_step<step>.png
    previews: Dict[str, Tensor] = field(default_factory=dict)
    scores: Dict[str, Tensor] = field(default_factory=dict)  # per-image values for after_step_all_ranks
    stats: Dict[str, Any] = field(default_factory=dict)  # global values of an applied step
    # set by the engine: whether the optimizer applied the update (finite gradients; the same on
    # every rank, whose gradients DDP all-reduced), and the gradient norm before clipping
    applied: bool = True
    grad_norm: Optional[float] = None

    @property
    def finite(self) -> bool:
        """The total loss and every term finite (one host sync)."""
        values = torch.stack([self.loss.detach().float().reshape(()),
                              *(t.detach().float().reshape(()) for t in self.losses.values())])
        return bool(torch.isfinite(values).all())


@dataclass
class MicroOutput:
    """One micro-batch: the loss to backpropagate (not yet divided by the accumulation count)
    and whatever the method keeps of it."""

    loss: Tensor
    terms: Dict[str, Tensor] = field(default_factory=dict)  # detached loss terms, by name
    keep: Dict[str, Tensor] = field(default_factory=dict)  # anything else (scores, previews)


def mean_terms(outputs: List[MicroOutput]) -> Dict[str, Tensor]:
    """Each loss term's mean over the micro-batches (equal sizes: the rank's mean)."""
    return {name: torch.stack([out.terms[name] for out in outputs]).mean()
            for name in outputs[0].terms}


class Method:
    """Base of a training method; subclasses set the class attributes and implement
    `micro_loss` and `step_result`."""

    name = "method"
    stage = 0  # written into training states: a state of another stage is refused
    streams: Tuple[Stream, ...] = ()  # the input streams `micro_loss` reads, in this order
    eval_samples = False  # periodic evaluation also draws samples (and FID)
    keep_best = False  # keep model_bestacc.pth / model_bestfid.pth
    log_final_step = False  # also log the training metrics at the run's last step
    # the loop's events at the start of a step, the first included, evaluating before the
    # update (the original DAT loop), or after the step that crosses an interval
    # (rebm.engine.events)
    events_at_step_start = False

    def __init__(self, method: MethodSection, model: ModelConfig, schedule: ScheduleSection):
        """A method reads the config's `method` section, and of the others what its rules and
        schedule need; a subclass keeps what it reads. Its config rules run first."""
        self.check_config(method, model, schedule)

    @classmethod
    def check_config(cls, method: MethodSection, model: ModelConfig, schedule: ScheduleSection,
                     origins: ConfigOrigins = BUILT_IN_CODE) -> None:
        """The method's own config rules, its stage's included (a ConfigError naming the key and
        where it was set, `origins.of(key)`: the command line or the config file); its entry
        point and `--check` run them first."""

    @classmethod
    def loss_streams(cls, method: MethodSection) -> int:
        """Micro-batches of activations one loss pass holds: one per input stream unless the
        method says otherwise. It sizes the evaluation batch and `--check`'s memory plan."""
        return len(cls.streams)

    def lr_scheduler(self, optimizer: torch.optim.Optimizer, last_step: int
                     ) -> Optional[torch.optim.lr_scheduler.LambdaLR]:
        """A LambdaLR stepped once per applied optimizer step, or None (constant rate). A
        LambdaLR, because a resumed run recomputes its rate from the config's lr and schedule at
        the restored step (rebm.engine.parts.schedule_from_settings)."""
        return None

    def micro_loss(self, ctx: StepContext, batch: MicroBatch, index: int, log_now: bool
                   ) -> MicroOutput:
        """Forward only: the loss of the `index`-th micro-batch of a step (already on the
        device; the engine divides it by the accumulation count and runs its backward) and
        what the method keeps of it. `log_now`: this step's metrics are logged."""
        raise NotImplementedError

    def step_result(self, outputs: List[MicroOutput], micro_batches: List[MicroBatch]
                    ) -> StepResult:
        """The step's result from its micro-batches' outputs (after the optimizer step)."""
        raise NotImplementedError

    def after_step_all_ranks(self, runtime: Runtime, result: StepResult) -> Dict[str, Any]:
        """Global statistics of an applied step (every rank calls this, collectives allowed);
        logged with the metrics."""
        return {}

    def summarize(self, totals: Dict[str, float]) -> Dict[str, float]:
        """Logged metrics from the metrics window summed over ranks and steps."""
        return {}

    def progress(self) -> Dict[str, Any]:
        """A few numbers for the progress bar."""
        return {}

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    def describe(self) -> str:
        return self.name

    def speed_options(self, device: torch.device) -> Optional[str]:
        """The method's own speed options as resolved on `device`, for the start-up log."""
        return None
