"""What the sections of bench_train.py share: the two configurations, timing, the parts of a
run built as the engine builds them, the loop's own step (timed), and running W ranks."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import resource
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from rebm import distributed as rd  # noqa: E402
from rebm.checkpoint.run_directory import RunDirectory  # noqa: E402
from rebm.config import BatchPlan, TrainConfig, load_config  # noqa: E402
from rebm.distributed import Runtime  # noqa: E402
from rebm.engine import trainer as trainer_module  # noqa: E402
from rebm.engine.parts import Parts, build_parts_all_ranks  # noqa: E402
from rebm.engine.trainer import Trainer  # noqa: E402
from rebm.methods.base import StepContext  # noqa: E402
from rebm.methods.dat import DAT  # noqa: E402
from rebm.training.train import make_training_method  # noqa: E402

QUICKSTART = os.path.join(ROOT, "experiments", "quickstart", "digits.yaml")
WRN_OVERRIDES = [
    "data.indist_dataset=cifar10",
    "data.outdist_dataset=noise",
    "data.num_classes=10",
    "data.image_size=32",
    "data.num_workers=0",
    "model.model_type=WideResNet16x4",
    "model.use_batchnorm=false",
    "batch_size=32",
    "attack.max_steps=10",
    "attack.step_size=1.0",
    "indist_attack_clf.max_steps=10",
    "indist_attack_clf.step_size=0.1",
    "indist_attack_clf.eps=0.5",
    "indist_attack_clf.norm=L2",
    "optimizer=sgd",
    "lr=1e-3",
    "wd=5e-4",
    "use_ema=true",
    "ema_decay=0.999",
    "amp=none",
    "augm_type_generation=original",
    "augm_type_classification=autoaugment_cutout",
    "wandb_disabled=true",
]
CONFIGS = ("quickstart", "wrn")
CPU = torch.device("cpu")


def describe(cfg: TrainConfig) -> str:
    """e.g. 'WideResNet16x4, 32 px, batch 32, T=10, K=10, amp none'."""
    return (f"{cfg.model.model_type}, {cfg.data.image_size} px, batch {cfg.schedule.batch_size}, "
            f"T={cfg.method.attack.max_steps}, K={cfg.method.indist_attack_clf.max_steps}, amp {cfg.distributed.amp}")


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def peak_rss_mib() -> float:
    """Peak resident set size of this process (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable, device: torch.device = CPU):
    """(fn(), wall seconds), synchronising CUDA before and after."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


class Stopwatch:
    """Accumulates wall time per named piece (synchronising CUDA at the boundaries)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: Dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        sync(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            sync(self.device)
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---------------------------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------------------------
def batch_override(overrides: Sequence[str]) -> int:
    for item in overrides:
        if item.startswith("batch_size="):
            return int(item.split("=", 1)[1])
    return 32


def ensure_fake_cifar(workdir: str, overrides: Sequence[str] = ()) -> str:
    """A fake CIFAR-10 in the real on-disk format under workdir (written once), with room for
    four batches of the configured size."""
    from rebm.standin.writers import write_fake_cifar10

    n_train = max(1024, 4 * batch_override(overrides))
    root = os.path.join(workdir, f"cifar_{n_train}")
    if not os.path.exists(os.path.join(root, "cifar-10-batches-py", "test_batch")):
        write_fake_cifar10(root, n_train=n_train, n_test=101)
    return root


def make_config(name: str, workdir: str, overrides: Sequence[str] = (), device: str = "auto"
                ) -> TrainConfig:
    """The named configuration with `overrides`, on `device`, without wandb, its run dir under
    workdir, and T fixed at attack.max_steps (the curriculum's steady state). Frozen."""
    if name == "quickstart":
        path, base = QUICKSTART, []
    elif name == "wrn":
        root = ensure_fake_cifar(workdir, overrides)
        path, base = None, [*WRN_OVERRIDES, f"data.indist_ds_dir={root}"]
    else:
        raise SystemExit(f"unknown --config {name!r}; use quickstart or wrn")
    # The sections time the eager step unless a variant asks otherwise: with no step limit,
    # `model.compile: auto` would compile every section's model.
    pinned = [] if any(o.startswith("model.compile=") for o in overrides) else ["model.compile=false"]
    items = [*base, *pinned, *overrides, f"device={device}", "wandb_disabled=true",
             "wandb_mode=disabled",
             f"run_dir={os.path.join(workdir, f'run_{name}')}"]
    t_cap = load_config(path, items).attack.max_steps  # the curriculum's cap on T
    return load_config(path, [*items, f"attack.start_step={t_cap}"])


# ---------------------------------------------------------------------------------------------
# The parts of a run and the loop's step
# ---------------------------------------------------------------------------------------------
@dataclass
class Bench:
    """One process's training setup: a real rebm.engine.trainer.Trainer (method: DAT) in a
    fresh run directory, and its parts, step context and batch plan."""

    cfg: TrainConfig
    runtime: Runtime
    plan: BatchPlan
    parts: Parts
    ctx: StepContext
    trainer: Trainer


def build(cfg: TrainConfig, runtime: Runtime, load_pretrained: bool = True) -> Parts:
    return build_parts_all_ranks(cfg, runtime, DAT(cfg.method, cfg.model, cfg.schedule), math.inf,
                                 load_pretrained=load_pretrained)


def setup(cfg: TrainConfig, runtime: Runtime) -> Bench:
    """A Trainer as `train` builds it, in cfg.run.run_dir emptied first but for its compile cache
    (so it never resumes a state an earlier section saved there, and a restart finds the
    compiled code), without periodic evaluation."""
    if runtime.is_main:  # everything but the compile cache, which a restart is meant to find
        os.makedirs(cfg.run.run_dir, exist_ok=True)
        for name in os.listdir(cfg.run.run_dir):
            if name != RunDirectory.COMPILE_CACHE:
                path = os.path.join(cfg.run.run_dir, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    rd.barrier(runtime)
    cfg = dataclasses.replace(cfg, n_imgs_per_evaluation_log=None)
    trainer = Trainer(cfg, runtime, make_training_method)
    return Bench(cfg, runtime, trainer.plan, trainer.parts, trainer.parts.step_context, trainer)


def single_process(args, overrides: Sequence[str] = ()) -> Bench:
    """A one-process section's setup: the config with `overrides`, the device, the thread count
    of the run, a 1-rank batch plan, freshly built parts."""
    cfg = make_config(args.config, args.workdir, [*args.set, *overrides], args.device)
    runtime = Runtime(device=torch.device("cuda" if args.device == "cuda" else "cpu"))
    torch.set_num_threads(args.threads)
    return setup(cfg, runtime)


def loop_step(bench: Bench, micro_batches) -> Dict[str, float]:
    """What Trainer.fit does per step after `next(batches)`: the log_now rule,
    `Trainer.train_step_all_ranks` (the update, EMA, global AUCs, curriculum, metrics window)
    and the consensus all-reduce. Returns seconds: {"dat_step" (the update:
    rebm.engine.step.update_all_ranks, timed inside), "total"}."""
    trainer, runtime = bench.trainer, bench.runtime
    inner: Dict[str, float] = {}
    update = trainer_module.update_all_ranks

    def timed_update(*args, **kwargs):
        out, inner["dat_step"] = timed(lambda: update(*args, **kwargs), runtime.device)
        return out

    def step() -> Dict[str, bool]:
        log_now = trainer.log_due(trainer.progress.step + 1)
        result = trainer.train_step_all_ranks(micro_batches, log_now)
        return rd.consensus(runtime, preempt=False,
                            nonfinite=not (result.applied and result.finite), write_failed=False)

    trainer_module.update_all_ranks = timed_update  # the loop's own call, timed from inside
    try:
        decision, total = timed(step, runtime.device)
    finally:
        trainer_module.update_all_ranks = update
    if decision["nonfinite"]:
        raise FloatingPointError("non-finite loss in the benchmark")
    return {"dat_step": inner["dat_step"], "total": total}


def section_result(section: str, args, bench: Bench, **fields) -> dict:
    """What every one-process section reports (what ran, on what, its peak memory), with the
    section's own figures in between."""
    return {"section": section, "config": args.config, "label": describe(bench.cfg),
            "threads": args.threads, "reps": args.reps,
            "params": n_params(bench.parts.raw_model), "batch_size": bench.cfg.schedule.batch_size,
            **fields, "max_rss_mib": [peak_rss_mib()]}


def prefetch(bench: Bench, n: int) -> List[list]:
    """The micro-batches of steps 0..n-1, built up front and already on the device."""
    from rebm.data import build_train_data

    data = build_train_data(bench.cfg.inputs, bench.runtime, bench.plan, DAT.streams)
    return [[mb.to(bench.runtime.device) for mb in data.step_batch(s)] for s in range(n)]


# ---------------------------------------------------------------------------------------------
# Several ranks
# ---------------------------------------------------------------------------------------------
def gather_floats(runtime: Runtime, values: Sequence[float]) -> List[List[float]]:
    """[[values of rank 0], [values of rank 1], ...] on every rank."""
    local = torch.tensor([list(values)], dtype=torch.float64)
    return rd.all_gather_cat(runtime, local).tolist()


def slowest_rank(runtime: Runtime, times: Sequence[float]) -> List[float]:
    """Per repetition the largest time over the ranks: a step ends when its slowest rank does."""
    return [max(col) for col in zip(*gather_floats(runtime, times), strict=True)]


def rss_per_rank(runtime: Runtime) -> List[float]:
    return [row[0] for row in gather_floats(runtime, [peak_rss_mib()])]


def write_json(path: str, result: dict) -> None:
    with open(path, "w") as fh:
        json.dump(result, fh, indent=2)


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_ranks(worker: Callable, opts: dict, world_size: int) -> dict:
    """worker(opts) on `world_size` spawned ranks (or on this rank under torchrun); rank 0
    writes opts["json"], which is returned (on rank 0)."""
    if launched_by_torchrun():
        worker(opts)
    else:
        rd.spawn(worker, world_size, opts)
    if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
        return {}
    with open(opts["json"]) as fh:
        return json.load(fh)
