"""What a training run is made of: the model and its wrappers, optimizer, scheduler, EMA,
precision, method, progress and run identity, built once per run. Each part that a training state
holds is Stateful (state_dict / load_state_dict) and is saved and loaded under its own key by one
loop (rebm.checkpoint.state)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Dict, List, Optional

import torch

from rebm.checkpoint.state import (
    ProcessRNG,
    StateError,
    Stateful,
    StateOfAnotherRun,
    check_fits,
    check_model_type,
    check_stage,
    check_weights_all_ranks,
    load_parts,
)
from rebm.config import TrainConfig
from rebm.config.optimizers import OptimizerSection
from rebm.config.schema import DataConfig, ModelConfig
from rebm.config.sections import EmaSection
from rebm.distributed.compile_cache import CompileCache
from rebm.distributed.parallel import attack_view, has_sync_batchnorm, scoring_view
from rebm.distributed.precision import Precision
from rebm.distributed.runtime import Runtime
from rebm.engine.build import build_model_all_ranks, get_compile_cache
from rebm.engine.ema import build_ema
from rebm.engine.metrics_window import MetricsWindow
from rebm.engine.optimizers import build_optimizer
from rebm.methods.base import Method, StepContext
from rebm.models import model_from_config

LOGGER = logging.getLogger("rebm")


@dataclass
class Progress:
    """Where the run is. `step` counts optimizer steps done; the data position follows from it.
    Stateful: a state keeps the bests, the metrics window and a pending evaluation; its step is
    the state's own (`state["step"]`, the file name's)."""

    is_main: bool = True  # the saved window is global: rank 0 alone carries it after a load
    step: int = 0
    best: Dict[str, float] = field(default_factory=dict)
    window: MetricsWindow = field(default_factory=MetricsWindow)  # sums since the last log
    last_eval: Dict[str, Any] = field(default_factory=dict)  # this process's newest evaluation
    last_eval_step: Optional[int] = None  # the step of last_eval
    eval_pending: bool = False  # a preemption abandoned the evaluation of this step
    steps_run: int = 0  # optimizer steps this process ran (0 on a rerun of a finished run)

    def state_dict(self) -> Dict[str, Any]:
        """Call `window.gather_all_ranks(runtime)` on every rank first: rank 0's window then holds
        the global sums."""
        return {"best": dict(self.best), "metrics_window": dict(self.window.sums),
                "eval_pending": self.eval_pending}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.best = dict(state.get("best", {}))
        self.window = MetricsWindow.restored(state["metrics_window"], self.is_main)
        self.eval_pending = bool(state.get("eval_pending", False))


@dataclass
class RunIdentity:
    """What ties a state to its tracked run: the wandb run id (resumed runs log to the same)."""

    wandb_run_id: Optional[str] = None

    def state_dict(self) -> Dict[str, Any]:
        return {"wandb_run_id": self.wandb_run_id}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.wandb_run_id = state.get("wandb_run_id")


@dataclass
class Parts:
    model: torch.nn.Module  # what forward/backward goes through (DDP / DataParallel / plain)
    raw_model: torch.nn.Module  # the unwrapped module: EMA, state dicts
    optimizer: torch.optim.Optimizer
    scheduler: Optional[torch.optim.lr_scheduler.LambdaLR]  # the method's; once per applied step
    ema: Optional[torch.nn.Module]
    precision: Precision
    training_method: Method
    progress: Progress
    identity: RunIdentity = field(default_factory=RunIdentity)
    live_batchnorm: bool = False  # model.use_batchnorm: BatchNorm normalises with batch stats
    compile_cache: Optional[CompileCache] = None  # model.compile: compiled code kept in run dir
    max_grad_norm: Optional[float] = None  # each update clips its gradients to this norm

    @cached_property
    def step_context(self) -> StepContext:
        """What a method's loss runs on (built once per run): the training wrapper, the
        attacks' view of it, the view its no-grad scores use and the run's autocast."""
        return StepContext(model=self.model, attacked=attack_view(self.model),
                           autocast=self.precision.autocast, scorer=scoring_view(self.model))

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
        return self.live_batchnorm and not has_sync_batchnorm(self.raw_model)

    def stateful(self) -> Dict[str, Stateful]:
        """The parts a training state holds, each under its own key."""
        parts: Dict[str, Stateful] = {"model": self.raw_model, "optimizer": self.optimizer}
        if self.scheduler is not None:
            parts["scheduler"] = self.scheduler
        if self.ema is not None:
            parts["ema"] = self.ema
        parts.update(scaler=self.precision, method=self.training_method, progress=self.progress,
                     rng=ProcessRNG(), tracker=self.identity)
        return parts

    def load_state_all_ranks(self, state: dict, runtime: Runtime) -> None:
        """Load a training state into every rank's parts and check that the replicas agree
        (every rank calls this: one all-reduce). The state brings back where the run is (weights,
        moments, the step, the curriculum); what the config sets comes from this run's config,
        so a value changed under resume=force applies from the resumed step."""
        settings = optimizer_settings(self.optimizer)  # built from this run's config
        load_parts(state, self.stateful())
        self.progress.step = int(state["step"])
        apply_optimizer_settings(self.optimizer, settings)
        if self.scheduler is not None:
            schedule_from_settings(self.scheduler)
        _, identical = check_weights_all_ranks(runtime, *self.replicated)
        if not identical:
            raise StateError(f"after loading '{state['_path']}' the ranks' weights differ")
        LOGGER.info("resumed from %s at step %d (%s)", state["_path"], self.progress.step,
                    self.training_method.describe())


def optimizer_settings(optimizer: torch.optim.Optimizer) -> List[Dict[str, Any]]:
    """Each parameter group's hyper-parameters (lr, weight decay, momentum, betas, ...; with a
    scheduler its `initial_lr`): everything in the group but its parameters."""
    return [{key: value for key, value in group.items() if key != "params"}
            for group in optimizer.param_groups]


def apply_optimizer_settings(optimizer: torch.optim.Optimizer,
                             settings: List[Dict[str, Any]]) -> None:
    """Put `settings` (optimizer_settings of the optimizer as the run built it) back after a
    load: torch's load_state_dict restores the saved run's hyper-parameters with its moments."""
    for group, own in zip(optimizer.param_groups, settings, strict=True):
        group.update(own)


def schedule_from_settings(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """A loaded LambdaLR keeps its step (`last_epoch`) and its factor (the run's schedule over
    the run's length: the lambda is never saved); its base rates become the optimizer's
    `initial_lr` (the run's lr, not the saved `base_lrs`), and each group's rate that of the
    restored step, as the scheduler's own step computes it (base rate x factor)."""
    optimizer = scheduler.optimizer
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs,
                                   scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(scheduler.last_epoch)


def build_parts_all_ranks(cfg: TrainConfig, runtime: Runtime, training_method: Method,
                          last_step: float, load_pretrained: bool = True) -> Parts:
    """Every part of a run; every rank calls this (wrapping in DDP broadcasts the weights)."""
    torch.manual_seed(cfg.schedule.rand_seed)  # same initial weights on every rank (DDP too)
    model, raw_model = build_model_all_ranks(cfg.network, runtime,
                                             load_pretrained=load_pretrained,
                                             planned_steps=last_step)
    method_options = training_method.speed_options(runtime.device)
    if method_options:
        LOGGER.info("speed options: %s", method_options)
    optimizer = build_optimizer(cfg.optimization, raw_model.parameters())
    return Parts(model=model, raw_model=raw_model, optimizer=optimizer,
                 scheduler=training_method.lr_scheduler(optimizer, last_step),
                 ema=build_ema(raw_model, cfg.ema),
                 precision=Precision(cfg.distributed.amp, runtime.device),
                 training_method=training_method, progress=Progress(is_main=runtime.is_main),
                 live_batchnorm=cfg.model.use_batchnorm,
                 compile_cache=get_compile_cache(cfg.network, cfg.run.run_dir, runtime,
                                                 last_step),
                 max_grad_norm=cfg.optimization.max_grad_norm)


def check_optimizer_type(state: Dict[str, Any], optimizer: str) -> None:
    """StateOfAnotherRun when the state's run trained with another `optimizer`: its moments
    (momentum, Adam's averages) and hyper-parameters mean nothing to another optimizer, and
    Adam's and AdamW's even have the same shapes, so only the recorded name tells them apart."""
    config = state.get("config")
    found = config.get("optimizer") if isinstance(config, dict) else None
    if isinstance(found, str) and found != optimizer:
        raise StateOfAnotherRun(
            f"'{state.get('_path', 'the training state')}' was trained with optimizer {found} "
            f"and this run builds {optimizer} (optimizer): a training state continues only its "
            f"own optimizer, even under resume=force; choose another run_dir, or "
            f"optimizer={found}")


def state_fit_check(model: ModelConfig, data: DataConfig, optimization: OptimizerSection,
                    ema: EmaSection, stage: int) -> Callable[[Dict[str, Any]], None]:
    """The check a state must pass before a run (training stage `stage`, its model, data,
    optimizer and EMA sections) trusts it: its stage, model_type and optimizer are the run's
    (else StateOfAnotherRun: no earlier state of that run is better), and its model, EMA and
    optimizer tensors have the shapes of the parts this run builds, built on the meta device
    for the check (no memory, no random numbers)."""
    def fits(state: Dict[str, Any]) -> None:
        check_stage(state, stage)
        check_model_type(state, model.model_type)
        check_optimizer_type(state, optimization.name)
        with torch.device("meta"):
            network = model_from_config(model, data)
            check_fits(state, network, build_optimizer(optimization, network.parameters()),
                       build_ema(network, ema))
    return fits
