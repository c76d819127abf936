"""Everything a training state holds, built once per run and saved/restored in one place."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from rebm.checkpoint.state import (
    StateError,
    load_training_state,
    replicas_identical,
    training_state,
)
from rebm.config import BatchPlan, TrainConfig
from rebm.distributed.parallel import attack_view, has_sync_batchnorm
from rebm.distributed.precision import Precision
from rebm.distributed.runtime import Runtime
from rebm.engine.build import get_model, get_optimizer
from rebm.engine.ema import build_ema
from rebm.engine.metrics import MetricsWindow
from rebm.methods.base import Method, StepContext

LOGGER = logging.getLogger("rebm")


@dataclass
class Progress:
    """Where the run is. `step` counts optimizer steps done; the data position follows from it."""

    step: int = 0
    best: Dict[str, float] = field(default_factory=dict)
    window: MetricsWindow = field(default_factory=MetricsWindow)  # sums since the last log
    wandb_run_id: Optional[str] = None
    last_eval: Dict[str, Any] = field(default_factory=dict)  # this process's newest evaluation
    last_eval_step: Optional[int] = None  # the step of last_eval
    eval_pending: bool = False  # a preemption abandoned the evaluation of this step
    steps_run: int = 0  # optimizer steps this process ran (0 on a rerun of a finished run)


@dataclass
class Parts:
    model: torch.nn.Module  # what forward/backward goes through (DDP / DataParallel / plain)
    raw_model: torch.nn.Module  # the unwrapped module: EMA, state dicts
    optimizer: torch.optim.Optimizer
    scheduler: Optional[Any]  # the method's LR scheduler, stepped once per optimizer step
    ema: Optional[torch.nn.Module]
    precision: Precision
    method: Method
    progress: Progress

    @property
    def eval_model(self) -> torch.nn.Module:
        """The model that is evaluated and exported: the EMA average when use_ema."""
        return self.ema.ema_model if self.ema is not None else self.raw_model

    @property
    def replicated(self) -> List[torch.nn.Module]:
        return [self.raw_model] + ([self.ema] if self.ema is not None else [])

    @property
    def live_unsynced_batchnorm(self) -> bool:
        """BatchNorm statistics from per-rank batches, which would drift apart between ranks."""
        return self.method.cfg.model.use_batchnorm and not has_sync_batchnorm(self.raw_model)

    def context(self, cfg: TrainConfig, plan: BatchPlan) -> StepContext:
        return StepContext(model=self.model, attacked=attack_view(self.model),
                           optimizer=self.optimizer, precision=self.precision, plan=plan, cfg=cfg)

    def state_dict(self, cfg: TrainConfig, world_size: int, window_sums: Dict[str, float]
                   ) -> dict:
        extra: Dict[str, Any] = dict(self.method.state_dict(), best=dict(self.progress.best),
                                     metrics_window=window_sums,
                                     eval_pending=self.progress.eval_pending)
        if self.scheduler is not None:
            extra["scheduler"] = self.scheduler.state_dict()
        return training_state(self.method.stage, self.progress.step, self.raw_model,
                              self.optimizer, self.ema, self.precision, cfg, world_size,
                              self.progress.wandb_run_id, **extra)

    def load_state_dict(self, state: dict, runtime: Runtime) -> None:
        """Load a training state into every rank's parts and check that the replicas agree."""
        load_training_state(state, self.method.stage, self.raw_model, self.optimizer, self.ema,
                            self.precision)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.method.load_state_dict(state)
        self.progress = Progress(step=int(state["step"]), best=dict(state.get("best", {})),
                                 # the saved window is global: carried by rank 0 alone
                                 window=MetricsWindow.restored(state["metrics_window"],
                                                               runtime.is_main),
                                 wandb_run_id=state.get("wandb_run_id"),
                                 eval_pending=bool(state.get("eval_pending", False)))
        if not replicas_identical(runtime, *self.replicated):
            raise StateError(f"after loading '{state['_path']}' the ranks' weights differ")
        LOGGER.info("resumed from %s at step %d (%s)", state["_path"], self.progress.step,
                    self.method.describe())


def build_parts(cfg: TrainConfig, runtime: Runtime, method: Method, last_step: float,
                load_pretrained: bool = True) -> Parts:
    torch.manual_seed(cfg.rand_seed)  # same initial weights on every rank (DDP also broadcasts)
    model, raw_model = get_model(cfg, runtime, load_pretrained=load_pretrained)
    optimizer = get_optimizer(cfg, raw_model.parameters())
    return Parts(model=model, raw_model=raw_model, optimizer=optimizer,
                 scheduler=method.lr_scheduler(optimizer, last_step),
                 ema=build_ema(raw_model, cfg), precision=Precision(cfg.amp, runtime.device),
                 method=method, progress=Progress())
