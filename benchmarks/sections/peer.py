"""Section `peer`: the update exactly as the loop calls it (`update_all_ranks`), float32, in the
variants of PEER_VARIANTS (interleaved): the old defaults, each speed option forced, and the
default of a long run; with the step's FLOPs and the machine's GEMM rate, to relate the step
time to what the hardware can do (the peer comparison, `wrn` config)."""

from __future__ import annotations

import copy
import functools
from typing import Dict, List

import torch

from rebm.engine.step import update_all_ranks
from sections.common import (
    median,
    prefetch,
    section_result,
    single_process,
    timed,
)

# The variants the peer comparison tries (all float32, the same arithmetic), interleaved:
# - nchw: the default before channels_last (NCHW, eager, two attack passes);
# - eager: the default before `model.compile: auto` and `fuse_attacks` (channels_last, eager,
#   two attack passes) - the baseline of the default's speed-up;
# - compiled / fused / compiled_fused: each option forced on top of `eager`;
# - default: what a long run gets by default (auto for both: compiled, fused where it pays).
PEER_VARIANTS = {
    "nchw": ["model.channels_last=false", "model.compile=false", "fuse_attacks=false"],
    "eager": ["model.compile=false", "fuse_attacks=false"],
    "compiled": ["model.compile=true", "fuse_attacks=false"],  # compiles in warm-up
    "fused": ["model.compile=false", "fuse_attacks=true"],
    "compiled_fused": ["model.compile=true", "fuse_attacks=true"],
    "default": ["model.compile=auto", "fuse_attacks=auto", "max_steps=100000"],
}


def step_gflop(raw_model: torch.nn.Module, batch, T: int, K: int) -> Dict[str, float]:
    """Floating-point work of one DAT step in GFLOP, counted by torch's FlopCounterMode on the
    real model: (T + K) attack steps (forward + input gradient, B images each) and the fused
    loss pass (forward + backward with parameter gradients, 3B images)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = copy.deepcopy(raw_model).eval()
    x = batch["in"].images.clone().requires_grad_(True)
    with FlopCounterMode(display=False) as counter:
        model(x).logsumexp(1).sum().backward(inputs=[x])  # only the input gradient, like PGD
    attack = counter.get_total_flops() / 1e9
    model.train()
    with FlopCounterMode(display=False) as counter:
        model(torch.cat([batch["in"].images, batch["out"].images, batch["clf"].images])).logsumexp(1).sum().backward()
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


def section_peer(args) -> dict:
    variants = {name: single_process(args, overrides)
                for name, overrides in PEER_VARIANTS.items()}
    base = variants["nchw"]
    cfg, parts, device = base.cfg, base.parts, base.runtime.device
    n = max(1, args.warmup) + args.reps  # at least one warm-up: it compiles the compiled variant
    prefetched = prefetch(base, n)
    T, K = parts.training_method.curriculum.T, cfg.method.indist_attack_clf.max_steps
    times: Dict[str, List[float]] = {name: [] for name in variants}
    for rep in range(n):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for name in order:
            v = variants[name]
            batches = prefetched[rep]
            _, seconds = timed(functools.partial(
                update_all_ranks, v.parts, v.plan, batches), device)
            if rep >= n - args.reps:
                times[name].append(seconds)
    flops = step_gflop(parts.raw_model, prefetched[0][0], T, K)
    gemm = gemm_gflops()
    step_s = {layout: median(values) for layout, values in times.items()}
    return section_result(
        "peer", args, base, T=T, K=K, dat_step_s=step_s, dat_step_all_s=times,
        speedup_over_nchw={k: step_s["nchw"] / v for k, v in step_s.items()},
        compiled={name: v.parts.model is not v.parts.raw_model for name, v in variants.items()},
        **flops, gemm_gflops=gemm,
        achieved_gflops={k: flops["step_gflop"] / v for k, v in step_s.items()})
