"""Section `ddp`: images/s of the loop's step on W ranks (rebm.distributed.spawn, gloo on CPU; or
under torchrun); with W > 1 also the gradient all-reduce, exposed (backward through DDP with and
without gradient synchronisation) and raw (one all-reduce as large as all gradients)."""

from __future__ import annotations

import contextlib
from typing import Dict, List

import torch
import torch.distributed as dist

from rebm import distributed as rd
from rebm.distributed.collectives import _comm_device
from rebm.methods.dat import DAT, dat_loss
from sections.common import (
    Bench,
    describe,
    ensure_fake_cifar,
    loop_step,
    make_config,
    median,
    n_params,
    rss_per_rank,
    run_ranks,
    setup,
    slowest_rank,
    timed,
    write_json,
)


def _comm_timings(bench: Bench, batch, reps: int) -> Dict[str, float]:
    """Backward through DDP with and without gradient synchronisation (no_sync), and a raw
    all-reduce of a buffer as large as all gradients together."""
    parts, runtime, method, cfg = bench.parts, bench.runtime, bench.parts.method, bench.cfg
    model = parts.model

    def forward_backward(synced: bool) -> None:
        parts.optimizer.zero_grad(set_to_none=True)
        model.train()
        with contextlib.nullcontext() if synced else model.no_sync():
            losses = dat_loss(model, batch["in"].images, batch["in"].labels, batch["out"].images, batch["clf"].images, batch["clf"].labels,
                              batch["out"].images, weights=method.weights, logsumexp=cfg.logsumexp,
                              r1reg=cfg.r1reg, fused=method.frozen_bn)
            losses.loss.backward()

    flat = torch.zeros(n_params(parts.raw_model), device=_comm_device(runtime))
    times: Dict[str, List[float]] = {"synced": [], "no_sync": [], "allreduce": []}
    for rep in range(reps + 1):
        for key in ("synced", "no_sync", "allreduce"):
            rd.barrier(runtime)
            if key == "allreduce":
                _, seconds = timed(lambda: dist.all_reduce(flat), runtime.device)
            else:
                _, seconds = timed(lambda k=key: forward_backward(k == "synced"), runtime.device)
            if rep >= 1:
                times[key].append(seconds)
    parts.optimizer.zero_grad(set_to_none=True)
    med = {k: median(v) for k, v in times.items()}
    return {"fwd_bwd_synced_s": med["synced"], "fwd_bwd_no_sync_s": med["no_sync"],
            "exposed_allreduce_s": max(0.0, med["synced"] - med["no_sync"]),
            "raw_allreduce_s": med["allreduce"],
            "grad_mib": flat.numel() * flat.element_size() / 2**20}


def _ddp_steps(bench: Bench, data, opts: dict) -> tuple:
    """(step seconds incl. data wait, data wait seconds) of the measured loop steps."""
    batches = iter(data)
    step_times, data_times = [], []
    for step in range(opts["warmup"] + opts["steps"]):
        rd.barrier(bench.runtime)
        micro_batches, t_data = timed(lambda: next(batches))  # noqa: B023
        times = loop_step(bench, micro_batches)
        if step >= opts["warmup"]:
            step_times.append(t_data + times["total"])
            data_times.append(t_data)
    return step_times, data_times


def _ddp_worker(opts: dict) -> None:
    from rebm.data import build_train_data

    runtime = rd.setup_distributed(use_ddp=True, backend=opts["backend"], device=opts["device"])
    torch.set_num_threads(opts["threads"])
    try:
        if runtime.is_main and opts["config"] == "wrn":
            ensure_fake_cifar(opts["workdir"], opts["set"])
        rd.barrier(runtime)
        bench = setup(make_config(opts["config"], opts["workdir"], opts["set"], opts["device"]),
                      runtime)
        cfg, plan = bench.cfg, bench.plan
        data = build_train_data(cfg, runtime, plan, DAT.streams)
        step_times, data_times = _ddp_steps(bench, data, opts)
        comm = {}
        if runtime.distributed:
            comm = _comm_timings(bench, data.step_batch(0)[0].to(runtime.device),
                                 opts["comm_reps"])
        step_s = median(slowest_rank(runtime, step_times))
        rss = rss_per_rank(runtime)
        if runtime.is_main:
            write_json(opts["json"], {
                "section": "ddp", "config": opts["config"], "label": describe(cfg),
                "world_size": runtime.world_size, "threads_per_rank": opts["threads"],
                "device": str(runtime.device), "backend": runtime.backend,
                "batch_size": cfg.batch_size, "per_device_batch_size": plan.per_device_batch_size,
                "accumulation_steps": plan.accumulation_steps, "steps": opts["steps"],
                "params": n_params(bench.parts.raw_model),
                "step_s": step_s, "data_wait_s": median(data_times),
                "images_per_s": cfg.batch_size / step_s,
                "max_rss_mib": rss, **comm,
            })
    finally:
        rd.teardown(runtime)


def section_ddp(args) -> dict:
    opts = dict(config=args.config, workdir=args.workdir, set=list(args.set), device=args.device,
                backend=args.backend, threads=args.threads, warmup=args.warmup, steps=args.reps,
                comm_reps=max(1, min(args.reps - 1, 4)), json=args.json + ".worker")
    return run_ranks(_ddp_worker, opts, args.world_size)
