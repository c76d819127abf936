"""What a training method is: its input streams, a step function and its metrics
(docs/design.md §6).

The engine (rebm.engine) owns everything around a step — data, processes, EMA, intervals,
evaluation, states. A method declares the input streams it reads (`streams`; the data pipeline
loads those only, and `loss_streams` sizes the evaluation batch and `--check`'s memory plan) and
owns the step itself: `Method.step` turns one optimizer step's micro-batches into an update and a
`StepResult`; `after_step` computes the global statistics it needs (every rank calls it,
collectives allowed); `summarize` turns the metrics window into the numbers logged. Method state
(e.g. DAT's curriculum) goes through state_dict/load_state_dict, under its own key of the
training state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from rebm.config import BatchPlan, TrainConfig
from rebm.data import MicroBatch, Stream
from rebm.distributed.parallel import micro_step_sync
from rebm.distributed.precision import Precision
from rebm.distributed.runtime import Runtime


@dataclass
class StepContext:
    """What a step works with; the engine builds it once per run."""

    model: nn.Module  # DDP / DataParallel / compiled wrapper: the loss forward and backward
    attacked: nn.Module  # attack_view(model): without DDP, through DataParallel, compiled if it is
    optimizer: torch.optim.Optimizer
    precision: Precision
    plan: BatchPlan

    @property
    def device(self) -> torch.device:
        return next(self.attacked.parameters()).device


@dataclass
class StepResult:
    """What one optimizer step leaves behind on this rank (all tensors detached)."""

    loss: Tensor  # the total loss, mean over this rank's micro-batches
    losses: Dict[str, Tensor]  # each loss term, same mean (e.g. {"ebm": ..., "clf": ...})
    window: Dict[str, float]  # sums this step adds to the metrics window (summed over ranks)
    # images the engine saves as grids every n_imgs_per_image_log, as <name>_step<step>.png
    previews: Dict[str, Tensor] = field(default_factory=dict)
    scores: Dict[str, Tensor] = field(default_factory=dict)  # per-image values for after_step
    stats: Dict[str, Any] = field(default_factory=dict)  # global values from `after_step`

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


def accumulate(ctx: StepContext, micro_batches: List[MicroBatch],
               micro_step: Callable[[MicroBatch, int], MicroOutput]) -> List[MicroOutput]:
    """One optimizer step over this rank's micro-batches: `micro_step(batch, index)` for each
    (batch already on the device), backward of its loss / accumulation_steps, DDP gradient
    all-reduce on the last micro-batch only (`no_sync` before it), then the optimizer step."""
    ctx.optimizer.zero_grad(set_to_none=True)
    outputs = []
    device = ctx.device
    for index, batch in enumerate(micro_batches):
        batch = batch.to(device, non_blocking=True)  # pinned by the loader on CUDA
        with micro_step_sync(ctx.model, last=index == len(micro_batches) - 1):
            out = micro_step(batch, index)
            ctx.precision.backward(out.loss / ctx.plan.accumulation_steps)
        outputs.append(out)
    ctx.precision.step(ctx.optimizer)
    return outputs


def mean_terms(outputs: List[MicroOutput]) -> Dict[str, Tensor]:
    """Each loss term's mean over the micro-batches (equal sizes: the rank's mean)."""
    return {name: torch.stack([out.terms[name] for out in outputs]).mean()
            for name in outputs[0].terms}


class Method:
    """Base of a training method; subclasses set the class attributes and implement `step`."""

    name = "method"
    stage = 0  # written into training states: a state of another stage is refused
    streams: Tuple[Stream, ...] = ()  # the input streams `step` reads, in this order
    eval_samples = False  # periodic evaluation also draws samples (and FID)
    keep_best = False  # keep model_bestacc.pth / model_bestfid.pth
    log_final_step = False  # also log the training metrics at the run's last step

    def __init__(self, cfg: TrainConfig):
        self.check_config(cfg)
        self.cfg = cfg

    @classmethod
    def check_config(cls, cfg: TrainConfig) -> None:
        """The method's own config rules (a ConfigError naming the key); `--check` runs them."""

    @classmethod
    def loss_streams(cls, cfg: TrainConfig) -> int:
        """Micro-batches of activations one loss pass holds: one per input stream unless the
        method says otherwise. It sizes the evaluation batch and `--check`'s memory plan."""
        return len(cls.streams)

    def lr_scheduler(self, optimizer: torch.optim.Optimizer, last_step: int) -> Optional[Any]:
        """A scheduler stepped once per optimizer step, or None (constant learning rate)."""
        return None

    def step(self, ctx: StepContext, micro_batches: List[MicroBatch], log_now: bool
             ) -> StepResult:
        raise NotImplementedError

    def after_step(self, runtime: Runtime, result: StepResult) -> Dict[str, Any]:
        """Global statistics of the step (every rank calls this); logged with the metrics."""
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
