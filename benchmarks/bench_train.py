"""Training-speed benchmark sections (one section per process; `benchmarks/run_all.py` runs them
all and prints the table). Every figure times the functions the training loop itself calls
(`dat_step`, `pgd_from_config`, `dat_loss`, `Precision`, `ema.update`, `global_aucs`,
`consensus`, `save_training_state`, `restore`, `build_train_data`, `evaluate_model`) with the
thread count set explicitly.

    .venv/bin/python benchmarks/bench_train.py SECTION [--config quickstart|wrn] [--threads N]
        [--world-size W] [--reps N] [--warmup N] [--json PATH] [--set key=value ...]

Sections:
  breakdown   step time split into data wait, negative attack, classifier attack,
              forward+backward, optimizer, EMA, bookkeeping, logging/checkpoint (amortized)
  steps       the loop's step vs a minimal hand-written PyTorch DAT step (interleaved), and
              dat_step alone
  peer        dat_step in NCHW, channels_last and compiled + channels_last (interleaved), the
              step's FLOPs and the machine's GEMM rate (the peer comparison, `wrn` config)
  ddp         images/s of the loop's step on W ranks (rebm.distributed.spawn, gloo on CPU; or
              under torchrun); with W > 1 also the gradient all-reduce (exposed and raw)
  attack      one PGD step (input gradient only) vs one training forward+backward
  eval        evaluate_model (accuracy + robust accuracy) on the digits test set, W ranks;
              --independent: each rank evaluates all of it at once (the contention ceiling)
  resume      restore + build_train_data(start_step=k) + first batch, k = 10 vs 10,000
  checkpoint  save_training_state of the WRN-16-4 training state (training is blocked for it)

Configs: `quickstart` = experiments/quickstart/digits.yaml (WRN-10-1, 16 px, batch 64, T = 10,
K = 5); `wrn` = CIFAR-shaped WRN-16-4 (2.75M params), 32 px, 10 classes, batch 32, T = 10,
K = 10, frozen BatchNorm, float32, SGD, EMA, fake CIFAR-10 in the real on-disk format. In every
section T is fixed at attack.max_steps (the end of the curriculum, its steady state).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Callable, Dict, List, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (ROOT, os.path.join(ROOT, "tests")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rebm import distributed as rd  # noqa: E402
from rebm.attacks.pgd import pgd_attack, pgd_from_config  # noqa: E402
from rebm.distributed import Runtime  # noqa: E402
from rebm.config import (  # noqa: E402
    TrainConfig,
    load_config,
    loss_weights,
    plan_batches,
)
from rebm.training.modeling import strip_parallel  # noqa: E402
from rebm.methods.dat.objective import dat_loss  # noqa: E402
from rebm.methods.dat.step import MetricsWindow, StepMetrics, global_aucs  # noqa: E402

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


def describe(cfg: TrainConfig) -> str:
    """e.g. 'WideResNet16x4, 32 px, batch 32, T=10, K=10, amp none'."""
    return (f"{cfg.model.model_type}, {cfg.data.image_size} px, batch {cfg.batch_size}, "
            f"T={cfg.attack.max_steps}, K={cfg.indist_attack_clf.max_steps}, amp {cfg.amp}")


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
def peak_rss_mib() -> float:
    """Peak resident set size of this process (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


CPU = torch.device("cpu")


def timed(fn: Callable, device: torch.device = CPU):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def _batch_override(overrides: Sequence[str]) -> int:
    for item in overrides:
        if item.startswith("batch_size="):
            return int(item.split("=", 1)[1])
    return 32


def ensure_fake_cifar(workdir: str, n_train: int) -> str:
    """A fake CIFAR-10 in the real on-disk format under workdir (written once)."""
    from fake_data import write_fake_cifar10

    root = os.path.join(workdir, f"cifar_{n_train}")
    if not os.path.exists(os.path.join(root, "cifar-10-batches-py", "test_batch")):
        write_fake_cifar10(root, n_train=n_train, n_test=101)
    return root


def make_config(name: str, workdir: str, overrides: Sequence[str] = (), device: str = "auto"
                ) -> TrainConfig:
    overrides = list(overrides)
    if name == "quickstart":
        cfg = load_config(QUICKSTART, overrides)
    elif name == "wrn":
        n_train = max(1024, 4 * _batch_override(overrides))
        root = ensure_fake_cifar(workdir, n_train)
        cfg = load_config(None, WRN_OVERRIDES + [f"data.indist_ds_dir={root}"] + overrides)
    else:
        raise SystemExit(f"unknown --config {name!r}; use quickstart or wrn")
    cfg.attack.start_step = cfg.attack.max_steps  # fixed T: the curriculum's steady state
    cfg.device = device
    cfg.wandb_disabled = True
    cfg.wandb_mode = "disabled"
    cfg.run_dir = os.path.join(workdir, f"run_{name}")
    return cfg


def build(cfg: TrainConfig, runtime: Runtime):
    from rebm.training.train import build_parts

    return build_parts(cfg, runtime)


def single_process(args, overrides: Sequence[str] = ()) -> tuple:
    """(cfg, runtime, plan, parts) of a one-process section: the config with `overrides`, the
    device, the thread count of the run, a 1-rank batch plan, and freshly built parts."""
    cfg = make_config(args.config, args.workdir, [*args.set, *overrides], args.device)
    runtime = Runtime(device=torch.device("cuda" if args.device == "cuda" else "cpu"))
    torch.set_num_threads(args.threads)
    return cfg, runtime, plan_batches(cfg, 1), build(cfg, runtime)


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def loop_step(parts, cfg: TrainConfig, plan, runtime: Runtime, micro_batches
              ) -> Dict[str, float]:
    """What train.py does per step after `next(batches)`: `train_one_step` (dat_step, EMA,
    global AUCs, curriculum, metrics window) and the consensus all-reduce. Returns seconds:
    {"dat_step" (timed inside train_one_step), "total"}."""
    from rebm.training import train as train_module

    device = runtime.device
    real_dat_step = train_module.dat_step
    inner: Dict[str, float] = {}

    def timed_dat_step(*args, **kwargs):
        sync(device)
        t0 = time.perf_counter()
        out = real_dat_step(*args, **kwargs)
        sync(device)
        inner["dat_step"] = time.perf_counter() - t0
        return out

    train_module.dat_step = timed_dat_step  # the loop's own function, timed from inside
    try:
        sync(device)
        t0 = time.perf_counter()
        _, metrics = train_module.train_one_step(parts, micro_batches, cfg, plan, runtime)
        decision = rd.consensus(runtime, preempt=False, nonfinite=not metrics.finite)
        sync(device)
        total = time.perf_counter() - t0
    finally:
        train_module.dat_step = real_dat_step
    if decision["nonfinite"]:
        raise FloatingPointError("non-finite loss in the benchmark")
    return {"dat_step": inner["dat_step"], "total": total}


# ---------------------------------------------------------------------------------------------
# Section: breakdown
# ---------------------------------------------------------------------------------------------
def _pieces_step(parts, cfg: TrainConfig, plan, runtime: Runtime, batches, watch: Stopwatch
                 ) -> tuple:
    """dat_step taken apart into the same calls, each timed; then EMA and bookkeeping."""
    raw = strip_parallel(parts.model)  # what dat_step attacks: no DDP, compiled if it is
    device = runtime.device
    precision = parts.precision
    frozen_bn = not cfg.model.use_batchnorm
    weights = loss_weights(cfg)
    T = parts.curriculum.T
    with watch("data_wait"):
        micro_batches = next(batches)
    with watch("optimizer"):
        parts.optimizer.zero_grad(set_to_none=True)
    ins, advs, ebms, clfs = [], [], [], []
    for index, batch in enumerate(micro_batches):
        with watch("data_wait"):
            batch = batch.to(device)
        raw.eval()
        with watch("neg_attack"), precision.autocast():
            x_adv = pgd_from_config(raw, batch.x_out, cfg.attack, steps=T, y=batch.y_in,
                                    objective="lse" if cfg.logsumexp_sampling else "logit",
                                    random_start_keys=batch.key_out)
        with watch("clf_attack"), precision.autocast():
            x_c_adv = pgd_from_config(raw, batch.x_c, cfg.indist_attack_clf, objective="ce",
                                      y=batch.y_c, random_start_keys=batch.key_c)
        with watch("fwd_bwd"):
            if not frozen_bn:
                with torch.no_grad():
                    ins.append(raw(batch.x_in).float().gather(1, batch.y_in[:, None])[:, 0])
                    advs.append(raw(x_adv).float().gather(1, batch.y_in[:, None])[:, 0])
            parts.model.train()
            last = index == len(micro_batches) - 1
            no_sync = getattr(parts.model, "no_sync", None)
            with contextlib.nullcontext() if last or no_sync is None else no_sync():
                with precision.autocast():
                    losses = dat_loss(parts.model, batch.x_in, batch.y_in, x_adv, x_c_adv,
                                      batch.y_c, batch.x_out, weights=weights,
                                      logsumexp=cfg.logsumexp, r1reg=cfg.r1reg, fused=frozen_bn)
                precision.backward(losses.loss / plan.accumulation_steps)
        ebms.append(losses.ebm.bce.detach())
        clfs.append(losses.clf.loss.detach())
        if frozen_bn:
            ins.append(losses.ebm.logit_in)
            advs.append(losses.ebm.logit_adv)
    with watch("optimizer"):
        precision.step(parts.optimizer)
    if parts.ema is not None:
        with watch("ema"):
            parts.ema.update()
    ebm, clf = torch.stack(ebms).mean(), torch.stack(clfs).mean()
    metrics = StepMetrics(ebm_loss=ebm, clf_loss=clf, in_scores=torch.cat(ins).float(),
                          adv_scores=torch.cat(advs).float(), clean_out_scores=None,
                          x_adv_preview=x_adv.detach(), finite=bool(torch.isfinite(ebm + clf)),
                          outdist_steps=T)
    with watch("bookkeeping"):
        parts.progress.step += 1
        adv_auc, _ = global_aucs(runtime, metrics)
        metrics.adv_auc = adv_auc
        parts.curriculum.update(adv_auc, cfg.batch_size)
        parts.progress.window.add(metrics)
        rd.consensus(runtime, preempt=False, nonfinite=not metrics.finite)
    return metrics, adv_auc


def section_breakdown(args) -> dict:
    from rebm.data.pipeline import build_train_data
    from rebm.checkpoint.state import replicas_identical
    from rebm.engine.tracking import Tracker
    from rebm.training.train import save_training_state

    cfg, runtime, plan, parts = single_process(args)
    os.makedirs(cfg.run_dir, exist_ok=True)
    tracker = Tracker(cfg, runtime, cfg.run_dir)
    data = build_train_data(cfg, runtime, plan, start_step=0)
    batches = iter(data)
    pieces: Dict[str, List[float]] = {}
    full: List[float] = []
    for rep in range(args.warmup + args.reps):
        watch = Stopwatch(runtime.device)
        metrics, adv_auc = _pieces_step(parts, cfg, plan, runtime, batches, watch)
        # The loop's logging, image grid and checkpoint, each once per rep; amortized below.
        window = parts.progress.window
        with watch("metrics_log"):
            summary = window.summary(runtime, 1.0, cfg, adv_auc=adv_auc,
                                     clean_auc=None, outdist_steps=parts.curriculum.T)
            summary["replicas_identical"] = replicas_identical(runtime, *parts.replicated)
            tracker.log(parts.progress.step, parts.progress.step * cfg.batch_size, 0, summary)
            parts.progress.window = MetricsWindow()
        with watch("image_log"):
            tracker.save_grid(metrics.x_adv_preview, f"bench_{rep:03d}.png")
        with watch("checkpoint"):
            save_training_state(parts, cfg, runtime, cfg.run_dir, tracker)
        # The real loop step on the next batch, for the sum-of-pieces check.
        with watch("data_wait_full"):
            micro_batches = next(batches)
        step_times = loop_step(parts, cfg, plan, runtime, micro_batches)
        if rep >= args.warmup:
            for key, value in watch.times.items():
                pieces.setdefault(key, []).append(value)
            full.append(step_times["total"] + watch.times["data_wait_full"])
    med = {k: median(v) for k, v in pieces.items()}
    per_step = lambda interval: cfg.batch_size / interval if interval else 0.0  # noqa: E731
    amortized = {
        "metrics_log": med["metrics_log"] * per_step(cfg.n_imgs_per_metrics_log),
        "image_log": med["image_log"] * per_step(cfg.n_imgs_per_image_log),
        "checkpoint": med["checkpoint"] * per_step(cfg.n_imgs_per_ckpt_save),
    }
    order = ["data_wait", "neg_attack", "clf_attack", "fwd_bwd", "optimizer", "ema",
             "bookkeeping"]
    per_step_s = {k: med.get(k, 0.0) for k in order}
    per_step_s["logging_checkpoint_amortized"] = sum(amortized.values())
    tracker.close()
    return {
        "section": "breakdown", "config": args.config, "label": describe(cfg),
        "threads": args.threads, "reps": args.reps, "params": n_params(parts.raw_model),
        "batch_size": cfg.batch_size, "T": parts.curriculum.T,
        "K": cfg.indist_attack_clf.max_steps,
        "per_step_s": per_step_s,
        "per_event_s": {k: med[k] for k in ("metrics_log", "image_log", "checkpoint")},
        "intervals_imgs": {"metrics_log": cfg.n_imgs_per_metrics_log,
                           "image_log": cfg.n_imgs_per_image_log,
                           "checkpoint": cfg.n_imgs_per_ckpt_save},
        "amortized_s": amortized,
        "sum_of_pieces_s": sum(per_step_s.values()),
        "full_loop_step_s": median(full),
        "max_rss_mib": [peak_rss_mib()],
    }


# ---------------------------------------------------------------------------------------------
# Section: steps (framework overhead vs a minimal loop; dat_step for the peer comparison)
# ---------------------------------------------------------------------------------------------
class MinimalDAT:
    """The same DAT math written directly in PyTorch, without rebm: two PGD loops, one fused
    forward, BCE + CE, backward, optimizer step (the config's SGD/Adam/AdamW), EMA of the
    weights. Only for the configurations the
    benchmark uses (L2 attacks, no random start, logsumexp energy, frozen BatchNorm, default
    loss weights, r1reg = 0)."""

    def __init__(self, raw_model: torch.nn.Module, cfg: TrainConfig):
        for name in ("attack", "indist_attack_clf"):
            attack = getattr(cfg, name)
            assert attack.norm == "L2" and not attack.random_start, name
        assert cfg.logsumexp and not cfg.logsumexp_sampling and cfg.r1reg == 0
        assert not cfg.model.use_batchnorm
        assert loss_weights(cfg) == (0.5, 0.0, 0.5)
        self.cfg = cfg
        self.model = copy.deepcopy(raw_model)
        params, name = self.model.parameters(), cfg.optimizer.lower()
        if name == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, nesterov=True,
                                             weight_decay=cfg.wd)
        elif name == "adam":
            self.optimizer = torch.optim.Adam(params, lr=cfg.lr, betas=(0.0, 0.99),
                                              weight_decay=cfg.wd)
        else:
            self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95),
                                               weight_decay=cfg.wd)
        self.params = [p for p in self.model.parameters()]
        self.ema = [p.detach().clone() for p in self.params]

    def pgd(self, x, y, steps: int, step_size: float, eps: float, ce: bool):
        x0 = x.detach()
        x_adv = x0
        for _ in range(steps):
            x_adv = x_adv.detach().requires_grad_(True)
            with torch.enable_grad():
                logits = self.model(x_adv)
                if ce:
                    loss = F.cross_entropy(logits, y, reduction="sum")
                else:
                    loss = logits.gather(1, y[:, None]).sum()
                (grad,) = torch.autograd.grad(loss, x_adv)
            norm = grad.flatten(1).norm(dim=1).clamp_min(1e-12).view(-1, 1, 1, 1)
            x_adv = x_adv.detach() + grad * (step_size / norm)
            if not math.isinf(eps):
                delta = x_adv - x0
                scale = eps / delta.flatten(1).norm(dim=1).clamp_min(eps).view(-1, 1, 1, 1)
                x_adv = x0 + delta * scale
            x_adv = x_adv.clamp(0.0, 1.0)
        return x_adv.detach()

    def step(self, batch, T: int) -> float:
        cfg, model = self.cfg, self.model
        model.eval()
        a, c = cfg.attack, cfg.indist_attack_clf
        x_adv = self.pgd(batch.x_out, batch.y_in, T, a.step_size, a.eps, ce=False)
        x_c = self.pgd(batch.x_c, batch.y_c, c.max_steps, c.step_size, c.eps, ce=True)
        model.train()
        b = batch.x_in.shape[0]
        logits = model(torch.cat([batch.x_in, x_adv, x_c]))
        energy = torch.logsumexp(logits[: 2 * b], dim=1)
        target = torch.cat([torch.ones(b), torch.zeros(b)]).to(energy)
        loss = (F.binary_cross_entropy_with_logits(energy, target)
                + F.cross_entropy(logits[2 * b:], batch.y_c))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_lerp_(self.ema, self.params, 1.0 - cfg.ema_decay)
        return float(loss.detach())


def section_steps(args) -> dict:
    from rebm.data.pipeline import build_train_data

    cfg, runtime, plan, parts = single_process(args)
    assert plan.accumulation_steps == 1
    minimal = MinimalDAT(parts.raw_model, cfg)
    data = build_train_data(cfg, runtime, plan)
    n = args.warmup + args.reps
    prefetched = [[mb.to(runtime.device) for mb in data.step_batch(s)] for s in range(n)]
    T = parts.curriculum.T
    loop_t, dat_t, min_t = [], [], []
    for rep in range(n):
        batch = prefetched[rep]
        order = ("loop", "minimal") if rep % 2 == 0 else ("minimal", "loop")
        for which in order:
            if which == "loop":
                times = loop_step(parts, cfg, plan, runtime, batch)
            else:
                _, seconds = timed(lambda b=batch: minimal.step(b[0], T), runtime.device)
        if rep >= args.warmup:
            loop_t.append(times["total"])
            dat_t.append(times["dat_step"])
            min_t.append(seconds)
    paired = [a / b for a, b in zip(loop_t, min_t, strict=True)]
    return {
        "section": "steps", "config": args.config, "label": describe(cfg),
        "threads": args.threads, "reps": args.reps, "params": n_params(parts.raw_model),
        "batch_size": cfg.batch_size, "T": T, "K": cfg.indist_attack_clf.max_steps,
        "image_size": cfg.data.image_size, "model": cfg.model.model_type,
        "dat_step_s": median(dat_t), "dat_step_all_s": dat_t,
        "loop_step_s": median(loop_t), "minimal_step_s": median(min_t),
        "overhead_ratio": median(loop_t) / median(min_t),
        "overhead_ratio_paired": median(paired),
        "max_rss_mib": [peak_rss_mib()],
    }


# ---------------------------------------------------------------------------------------------
# Section: peer (dat_step in float32, NCHW vs channels_last, against the machine's FLOP rate)
# ---------------------------------------------------------------------------------------------
def step_gflop(raw_model: torch.nn.Module, batch, T: int, K: int) -> Dict[str, float]:
    """Floating-point work of one dat_step in GFLOP, counted by torch's FlopCounterMode on the
    real model: (T + K) attack steps (forward + input gradient, B images each) and the fused
    loss pass (forward + backward with parameter gradients, 3B images)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = copy.deepcopy(raw_model).eval()
    x = batch.x_in.clone().requires_grad_(True)
    with FlopCounterMode(display=False) as counter:
        model(x).logsumexp(1).sum().backward(inputs=[x])  # only the input gradient, like PGD
    attack = counter.get_total_flops() / 1e9
    model.train()
    with FlopCounterMode(display=False) as counter:
        model(torch.cat([batch.x_in, batch.x_out, batch.x_c])).logsumexp(1).sum().backward()
    loss_pass = counter.get_total_flops() / 1e9
    return {"attack_step_gflop": attack, "loss_pass_gflop": loss_pass,
            "step_gflop": (T + K) * attack + loss_pass}


def gemm_gflops(reps: int = 10, n: int = 2048) -> float:
    """Median float32 GFLOP/s of an n x n matrix product at the current thread count: what
    this machine's BLAS reaches on the friendliest dense workload there is."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    times = [timed(lambda: a @ b)[1] for _ in range(reps)]
    return 2 * n**3 / median(times) / 1e9


# The speed options the peer comparison tries (all float32, the same arithmetic).
PEER_VARIANTS = {
    "nchw": [],
    "channels_last": ["model.channels_last=true"],
    "compiled": ["model.channels_last=true", "model.compile=true"],  # compiles in warm-up
}


def section_peer(args) -> dict:
    """dat_step exactly as the loop calls it, float32, in each of PEER_VARIANTS (interleaved),
    plus the FLOPs of the step and the machine's measured GEMM rate, to relate step times to
    what the hardware can do."""
    from rebm.data.pipeline import build_train_data
    from rebm.methods.dat.step import Precision, dat_step

    variants = {}
    for name, overrides in PEER_VARIANTS.items():
        cfg, runtime, plan, parts = single_process(args, overrides)
        variants[name] = (cfg, plan, parts)
    cfg, plan, parts = variants["nchw"]
    data = build_train_data(cfg, runtime, plan)
    n = max(1, args.warmup) + args.reps  # at least one warm-up: it compiles the compiled variant
    prefetched = [[mb.to(runtime.device) for mb in data.step_batch(s)] for s in range(n)]
    T, K = parts.curriculum.T, cfg.indist_attack_clf.max_steps
    times: Dict[str, List[float]] = {name: [] for name in variants}
    for rep in range(n):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for name in order:
            v_cfg, v_plan, v_parts = variants[name]
            precision = Precision.from_config(v_cfg, runtime.device)
            _, seconds = timed(functools.partial(dat_step, v_parts.model, v_parts.optimizer,
                                                 prefetched[rep], T, v_cfg, v_plan, precision),
                               runtime.device)
            if rep >= n - args.reps:
                times[name].append(seconds)
    flops = step_gflop(parts.raw_model, prefetched[0][0], T, K)
    gemm = gemm_gflops()
    step_s = {layout: median(values) for layout, values in times.items()}
    return {
        "section": "peer", "config": args.config, "label": describe(cfg),
        "threads": args.threads, "reps": args.reps, "T": T, "K": K,
        "params": n_params(parts.raw_model), "batch_size": cfg.batch_size,
        "dat_step_s": step_s, "dat_step_all_s": times,
        "speedup_over_nchw": {k: step_s["nchw"] / v for k, v in step_s.items()},
        **flops, "gemm_gflops": gemm,
        "achieved_gflops": {k: flops["step_gflop"] / v for k, v in step_s.items()},
        "max_rss_mib": [peak_rss_mib()],
    }


# ---------------------------------------------------------------------------------------------
# Section: ddp (images/s on W ranks; gradient all-reduce)
# ---------------------------------------------------------------------------------------------
def _gather_floats(runtime: Runtime, values: Sequence[float]) -> List[List[float]]:
    """[[values of rank 0], [values of rank 1], ...] on every rank."""
    local = torch.tensor([list(values)], dtype=torch.float64)
    return rd.all_gather_cat(runtime, local).tolist()


def _comm_timings(parts, cfg, runtime: Runtime, batch, reps: int) -> Dict[str, float]:
    """Backward through DDP with and without gradient synchronisation (no_sync), and a raw
    all-reduce of a buffer as large as all gradients together."""
    model = parts.model
    frozen_bn = not cfg.model.use_batchnorm
    weights = loss_weights(cfg)
    device = runtime.device

    def forward_backward(synced: bool) -> None:
        parts.optimizer.zero_grad(set_to_none=True)
        model.train()
        with contextlib.nullcontext() if synced else model.no_sync():
            losses = dat_loss(model, batch.x_in, batch.y_in, batch.x_out, batch.x_c, batch.y_c,
                              batch.x_out, weights=weights, logsumexp=cfg.logsumexp,
                              r1reg=cfg.r1reg, fused=frozen_bn)
            losses.loss.backward()

    flat = torch.zeros(n_params(parts.raw_model), device=rd._comm_device(runtime))
    times: Dict[str, List[float]] = {"synced": [], "no_sync": [], "allreduce": []}
    for rep in range(reps + 1):
        for key in ("synced", "no_sync", "allreduce"):
            rd.barrier(runtime)
            if key == "allreduce":
                _, seconds = timed(lambda: dist.all_reduce(flat), device)
            else:
                _, seconds = timed(lambda k=key: forward_backward(k == "synced"), device)
            if rep >= 1:
                times[key].append(seconds)
    parts.optimizer.zero_grad(set_to_none=True)
    med = {k: median(v) for k, v in times.items()}
    return {"fwd_bwd_synced_s": med["synced"], "fwd_bwd_no_sync_s": med["no_sync"],
            "exposed_allreduce_s": max(0.0, med["synced"] - med["no_sync"]),
            "raw_allreduce_s": med["allreduce"],
            "grad_mib": flat.numel() * flat.element_size() / 2**20}


def _ddp_worker(opts: dict) -> None:
    runtime = rd.setup_distributed(use_ddp=True, backend=opts["backend"], device=opts["device"])
    torch.set_num_threads(opts["threads"])
    try:
        if runtime.is_main and opts["config"] == "wrn":
            ensure_fake_cifar(opts["workdir"], max(1024, 4 * _batch_override(opts["set"])))
        rd.barrier(runtime)
        cfg = make_config(opts["config"], opts["workdir"], opts["set"], opts["device"])
        from rebm.data.pipeline import build_train_data

        plan = plan_batches(cfg, runtime.world_size)
        parts = build(cfg, runtime)
        data = build_train_data(cfg, runtime, plan)
        batches = iter(data)
        step_times, data_times = [], []
        for step in range(opts["warmup"] + opts["steps"]):
            rd.barrier(runtime)
            micro_batches, t_data = timed(lambda: next(batches))  # noqa: B023
            times = loop_step(parts, cfg, plan, runtime, micro_batches)
            if step >= opts["warmup"]:
                step_times.append(t_data + times["total"])
                data_times.append(t_data)
        comm = {}
        if runtime.distributed:
            batch = data.step_batch(0)[0].to(runtime.device)
            comm = _comm_timings(parts, cfg, runtime, batch, opts["comm_reps"])
        # A step ends when the slowest rank ends it: take the max over ranks per step.
        per_rank = _gather_floats(runtime, step_times)
        per_step = [max(col) for col in zip(*per_rank, strict=True)]
        rss = [row[0] for row in _gather_floats(runtime, [peak_rss_mib()])]
        if runtime.is_main:
            step_s = median(per_step)
            result = {
                "section": "ddp", "config": opts["config"], "label": describe(cfg),
                "world_size": runtime.world_size, "threads_per_rank": opts["threads"],
                "device": str(runtime.device), "backend": runtime.backend,
                "batch_size": cfg.batch_size, "per_device_batch_size": plan.per_device_batch_size,
                "accumulation_steps": plan.accumulation_steps, "steps": opts["steps"],
                "params": n_params(parts.raw_model),
                "step_s": step_s, "data_wait_s": median(data_times),
                "images_per_s": cfg.batch_size / step_s,
                "max_rss_mib": rss, **comm,
            }
            with open(opts["json"], "w") as fh:
                json.dump(result, fh, indent=2)
    finally:
        rd.teardown(runtime)


def _launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _run_ranks(worker: Callable, opts: dict, world_size: int) -> dict:
    if _launched_by_torchrun():
        worker(opts)
    else:
        rd.spawn(worker, world_size, opts)
    if _launched_by_torchrun() and int(os.environ["RANK"]) != 0:
        return {}
    with open(opts["json"]) as fh:
        return json.load(fh)


def section_ddp(args) -> dict:
    opts = dict(config=args.config, workdir=args.workdir, set=list(args.set), device=args.device,
                backend=args.backend, threads=args.threads, warmup=args.warmup, steps=args.reps,
                comm_reps=max(1, min(args.reps - 1, 4)), json=args.json + ".worker")
    return _run_ranks(_ddp_worker, opts, args.world_size)


# ---------------------------------------------------------------------------------------------
# Section: eval
# ---------------------------------------------------------------------------------------------
def _eval_worker(opts: dict) -> None:
    from rebm.eval.evaluate import eval_batch_size, evaluate_model
    from rebm.models import build_model, dataset_stats

    runtime = rd.setup_distributed(use_ddp=True, backend=opts["backend"], device=opts["device"])
    torch.set_num_threads(opts["threads"])
    try:
        cfg = make_config("quickstart", opts["workdir"], opts["set"], opts["device"])
        cfg.robust_eval = True
        torch.manual_seed(cfg.rand_seed)
        mean, std = dataset_stats(cfg.data.indist_dataset)
        model = build_model(cfg.model.model_type, cfg.data.num_classes, mean=mean, std=std,
                            use_batchnorm=cfg.model.use_batchnorm).to(runtime.device)
        # independent: every rank evaluates the whole test set on its own (no sharding, no
        # collective inside), all starting together: how much the ranks slow each other down
        # on this machine's shared cores, caches and memory (the ceiling of any 2-rank split).
        eval_runtime = Runtime(device=runtime.device) if opts["independent"] else runtime
        times = []
        for rep in range(opts["warmup"] + opts["reps"]):
            rd.barrier(runtime)
            result, seconds = timed(lambda: evaluate_model(model, cfg, eval_runtime,
                                                           samples=False), runtime.device)
            if rep >= opts["warmup"]:
                times.append(seconds)
        per_rank = _gather_floats(runtime, times)
        per_rep = [max(col) for col in zip(*per_rank, strict=True)]
        rss = [row[0] for row in _gather_floats(runtime, [peak_rss_mib()])]
        if runtime.is_main:
            with open(opts["json"], "w") as fh:
                json.dump({
                    "section": "eval", "world_size": runtime.world_size,
                    "independent": opts["independent"],
                    "threads_per_rank": opts["threads"], "n_test": result["n_test"],
                    "robust_eval_steps": cfg.robust_eval_steps or cfg.indist_attack_clf.max_steps,
                    "eval_batch_per_rank": eval_batch_size(cfg, eval_runtime),
                    "eval_s": median(per_rep), "eval_all_s": per_rep,
                    "test_acc": result["test_acc"],
                    "robust_test_acc": result.get("robust_test_acc"),
                    "max_rss_mib": rss,
                }, fh, indent=2)
    finally:
        rd.teardown(runtime)


def section_eval(args) -> dict:
    opts = dict(workdir=args.workdir, set=list(args.set), device=args.device,
                backend=args.backend, threads=args.threads, warmup=args.warmup, reps=args.reps,
                independent=args.independent, json=args.json + ".worker")
    return _run_ranks(_eval_worker, opts, args.world_size)


# ---------------------------------------------------------------------------------------------
# Section: attack
# ---------------------------------------------------------------------------------------------
def section_attack(args) -> dict:
    """One PGD step (gradient w.r.t. the input only) vs one training forward+backward with
    parameter gradients, same batch, eval-mode (frozen-BN) model; interleaved repetitions.
    benchmarks/bench_attack.py prints the same comparison for more models."""
    from rebm.models import build_model

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    out = {"section": "attack", "threads": args.threads, "reps": args.reps, "models": {}}
    for name, model_type, size, batch in (("quickstart", "WideResNet10x1", 16, 64),
                                          ("wrn", "WideResNet16x4", 32, 32)):
        torch.manual_seed(0)
        model = build_model(model_type, 10).to(device).eval()
        x = torch.rand(batch, 3, size, size, device=device)
        y = torch.randint(0, 10, (batch,), device=device)

        def attack_step(model=model, x=x, y=y):
            pgd_attack(model, x, steps=1, step_size=0.1, objective="logit", y=y)

        def train_step(model=model, x=x, y=y):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()

        times: Dict[str, List[float]] = {"attack": [], "train": []}
        for rep in range(args.warmup + args.reps):
            for key, fn in (("attack", attack_step), ("train", train_step)):
                _, seconds = timed(fn, device)
                if rep >= args.warmup:
                    times[key].append(seconds)
        paired = [a / t for a, t in zip(times["attack"], times["train"], strict=True)]
        out["models"][name] = {
            "model": model_type, "image_size": size, "batch": batch,
            "attack_step_s": median(times["attack"]), "fwd_bwd_s": median(times["train"]),
            "ratio": median(times["attack"]) / median(times["train"]),
            "ratio_paired": median(paired),
        }
    out["max_rss_mib"] = [peak_rss_mib()]
    return out


# ---------------------------------------------------------------------------------------------
# Section: resume
# ---------------------------------------------------------------------------------------------
def section_resume(args) -> dict:
    from rebm.data.pipeline import build_train_data
    from rebm.checkpoint.state import list_states, read_state
    from rebm.training.train import restore, resume_state, save_training_state

    cfg, runtime, plan, parts = single_process(args)
    steps = (10, 10_000)
    paths = {}
    tracker = SimpleNamespace(wandb_run_id=None)  # what save_training_state reads of it
    for k in steps:  # one state per resume point, in its own run dir, written as the loop does
        run_dir = os.path.join(args.workdir, f"resume_{args.config}_{k}")
        parts.progress.step = k
        save_training_state(parts, cfg, runtime, run_dir, tracker)
        paths[k] = (run_dir, list_states(run_dir)[0])
    cfg.resume_from_state = None
    times = {k: {"read_state": [], "restore": [], "data_first_batch": [], "total": []}
             for k in steps}
    for rep in range(args.warmup + args.reps):
        for k in (steps if rep % 2 == 0 else steps[::-1]):
            run_dir, path = paths[k]
            _, t_read = timed(lambda p=path: read_state(p))
            fresh = build(cfg, runtime)
            _, t_restore = timed(lambda f=fresh, d=run_dir: restore(
                f, resume_state(cfg, runtime, d), runtime))
            assert fresh.progress.step == k

            def first_batch(k=k):
                data = build_train_data(cfg, runtime, plan, start_step=k)
                return next(iter(data))

            batch, t_data = timed(first_batch)
            assert batch[0].step == k
            if rep >= args.warmup:
                times[k]["read_state"].append(t_read)
                times[k]["restore"].append(t_restore)
                times[k]["data_first_batch"].append(t_data)
                times[k]["total"].append(t_restore + t_data)
    med = {str(k): {name: median(v) for name, v in times[k].items()} for k in steps}
    return {
        "section": "resume", "config": args.config, "label": describe(cfg),
        "threads": args.threads, "reps": args.reps,
        "state_mib": os.path.getsize(paths[steps[0]][1]) / 2**20,
        "at_step": med,
        "difference_s": med[str(steps[1])]["total"] - med[str(steps[0])]["total"],
        "max_rss_mib": [peak_rss_mib()],
    }


# ---------------------------------------------------------------------------------------------
# Section: checkpoint
# ---------------------------------------------------------------------------------------------
def section_checkpoint(args) -> dict:
    from rebm.checkpoint.state import list_states, read_state
    from rebm.training.train import save_training_state

    cfg, runtime, _, parts = single_process(args)
    # One cheap optimizer step so the state holds momentum buffers and an updated EMA.
    raw = parts.raw_model
    x = torch.rand(2, 3, cfg.data.image_size, cfg.data.image_size, device=runtime.device)
    F.cross_entropy(parts.model(x), torch.zeros(2, dtype=torch.long, device=x.device)).backward()
    parts.optimizer.step()
    if parts.ema is not None:
        parts.ema.update()
    tracker = SimpleNamespace(wandb_run_id=None)  # what save_training_state reads of it
    run_dir = os.path.join(args.workdir, f"checkpoint_{args.config}")
    assemble, blocked, reads = [], [], []
    for rep in range(args.warmup + args.reps):
        parts.progress.step = 1000 * (rep + 1)
        _, t_assemble = timed(lambda: parts.state_dict(cfg, 1, None))
        _, t_blocked = timed(lambda: save_training_state(parts, cfg, runtime, run_dir, tracker))
        _, t_read = timed(lambda: read_state(list_states(run_dir)[0]))
        if rep >= args.warmup:
            assemble.append(t_assemble)
            blocked.append(t_blocked)
            reads.append(t_read)
    size = os.path.getsize(list_states(run_dir)[0])
    write_s = median(blocked)
    steps_per_ckpt = cfg.n_imgs_per_ckpt_save / cfg.batch_size
    return {
        "section": "checkpoint", "config": args.config, "label": describe(cfg),
        "params": n_params(raw), "state_mib": size / 2**20, "dir": args.workdir,
        "save_training_state_s": write_s, "state_dict_assembly_s": median(assemble),
        "read_state_s": median(reads), "write_mib_per_s": size / 2**20 / write_s,
        "training_blocked_s": write_s,
        "every_n_steps": steps_per_ckpt,
        "max_rss_mib": [peak_rss_mib()],
    }


SECTIONS = {
    "breakdown": section_breakdown,
    "steps": section_steps,
    "peer": section_peer,
    "ddp": section_ddp,
    "eval": section_eval,
    "attack": section_attack,
    "resume": section_resume,
    "checkpoint": section_checkpoint,
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("section", choices=sorted(SECTIONS))
    parser.add_argument("--config", default="quickstart", choices=CONFIGS)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process")
    parser.add_argument("--world-size", type=int, default=1,
                        help="ranks for ddp/eval (spawned here; ignored under torchrun)")
    parser.add_argument("--reps", type=int, default=3, help="measured repetitions (steps)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured repetitions first")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--workdir", default=None, help="temporary files (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the result here (default: stdout)")
    parser.add_argument("--independent", action="store_true",
                        help="eval: every rank evaluates the whole test set by itself")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides, e.g. --set batch_size=1024")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("REBM_NO_PROGRESS", "1")
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            args.workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="rebm_bench_"))
        os.makedirs(args.workdir, exist_ok=True)
        if args.json is None:
            args.json = os.path.join(args.workdir, f"{args.section}.json")
            to_stdout = True
        else:
            to_stdout = False
        result = SECTIONS[args.section](args)
        if result:
            result.setdefault("torch", torch.__version__)
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=2)
            if to_stdout:
                print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
