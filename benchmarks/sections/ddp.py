"""Section `ddp`: images/s of the loop's step on W ranks (rebm.distributed.spawn, gloo on CPU; or
under torchrun); with W > 1 also the gradient all-reduce, exposed (backward through DDP with and
without gradient synchronisation) and raw (one all-reduce as large as all gradients).

`section_ddp_efficiency` (`python benchmarks/sections/ddp.py [--rounds N] [bench_train options]`)
runs the data-parallel efficiency comparison of docs/performance.md: the same global batch on 1
rank x 2 threads and on 2 ranks x 1 thread, alternating which goes first, N rounds; it reports
each side's median images/s and their ratio (target >= 0.90)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Dict, List

if __name__ == "__main__":  # run as a script: the benchmarks folder is the import root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from rebm import distributed as rd
from rebm.distributed.collectives import _comm_device
from rebm.methods.dat import dat_loss
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
    parts, runtime, training_method = bench.parts, bench.runtime, bench.parts.training_method
    model = parts.model

    def forward_backward(synced: bool) -> None:
        parts.optimizer.zero_grad(set_to_none=True)
        model.train()
        with contextlib.nullcontext() if synced else model.no_sync():
            losses = dat_loss(model, batch["in"].images, batch["in"].labels,
                              batch["out"].images, batch["clf"].images, batch["clf"].labels,
                              batch["out"].images, training_method.loss_options)
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


def _ddp_steps(bench: Bench, opts: dict) -> tuple:
    """(step seconds incl. data wait, data wait seconds, the first step's micro-batches) of the
    measured loop steps, on the Trainer's own data."""
    batches = iter(bench.trainer.data)
    step_times, data_times, first = [], [], None
    for step in range(opts["warmup"] + opts["steps"]):
        rd.barrier(bench.runtime)
        micro_batches, t_data = timed(lambda: next(batches))  # noqa: B023
        first = first or micro_batches
        times = loop_step(bench, micro_batches)
        if step >= opts["warmup"]:
            step_times.append(t_data + times["total"])
            data_times.append(t_data)
    return step_times, data_times, first


def _ddp_worker(opts: dict) -> None:
    runtime = rd.setup_distributed(use_ddp=True, backend=opts["backend"], device=opts["device"])
    torch.set_num_threads(opts["threads"])
    try:
        if runtime.is_main and opts["config"] == "wrn":
            ensure_fake_cifar(opts["workdir"], opts["set"])
        rd.barrier(runtime)
        bench = setup(make_config(opts["config"], opts["workdir"], opts["set"], opts["device"]),
                      runtime)
        cfg, plan = bench.cfg, bench.plan
        step_times, data_times, first = _ddp_steps(bench, opts)
        comm = {}
        if runtime.distributed and opts["comm_reps"]:
            comm = _comm_timings(bench, first[0].to(runtime.device), opts["comm_reps"])
        step_s = median(slowest_rank(runtime, step_times))
        rss = rss_per_rank(runtime)
        if runtime.is_main:
            write_json(opts["json"], {
                "section": "ddp", "config": opts["config"], "label": describe(cfg),
                "world_size": runtime.world_size, "threads_per_rank": opts["threads"],
                "device": str(runtime.device), "backend": runtime.backend,
                "batch_size": cfg.schedule.batch_size, "per_device_batch_size": plan.per_device_batch_size,
                "accumulation_steps": plan.accumulation_steps, "steps": opts["steps"],
                "params": n_params(bench.parts.raw_model),
                "step_s": step_s, "data_wait_s": median(data_times),
                "images_per_s": cfg.schedule.batch_size / step_s,
                "max_rss_mib": rss, **comm,
            })
    finally:
        rd.teardown(runtime)


def section_ddp(args) -> dict:
    opts = dict(config=args.config, workdir=args.workdir, set=list(args.set), device=args.device,
                backend=args.backend, threads=args.threads, warmup=args.warmup, steps=args.reps,
                comm_reps=max(1, min(args.reps - 1, 4)), json=args.json + ".worker")
    return run_ranks(_ddp_worker, opts, args.world_size)


def section_ddp_efficiency(args, rounds: int = 3) -> dict:
    """images/s of 1 rank x 2 threads and of 2 ranks x 1 thread (the same global batch),
    `rounds` times each, alternating which runs first (the machine's load drifts); the
    efficiency is the ratio of the medians."""
    runs: Dict[str, List[float]] = {"1x2": [], "2x1": []}
    for index in range(rounds):
        order = ("1x2", "2x1") if index % 2 == 0 else ("2x1", "1x2")
        for layout in order:
            world_size, threads = (1, 2) if layout == "1x2" else (2, 1)
            opts = dict(config=args.config, workdir=args.workdir, set=list(args.set),
                        device=args.device, backend=args.backend, threads=threads,
                        warmup=args.warmup, steps=args.reps, comm_reps=0,
                        json=f"{args.json}.{layout}.worker")
            runs[layout].append(run_ranks(_ddp_worker, opts, world_size)["images_per_s"])
    one, two = median(runs["1x2"]), median(runs["2x1"])
    return {"section": "ddp_efficiency", "config": args.config, "rounds": rounds,
            "steps_per_run": args.reps, "warmup": args.warmup,
            "images_per_s_1rank_2threads": one, "images_per_s_2ranks_1thread": two,
            "all_images_per_s": runs, "efficiency": two / one,
            "efficiency_per_round": [b / a for a, b in zip(runs["1x2"], runs["2x1"],
                                                            strict=True)]}


if __name__ == "__main__":
    import argparse
    import json
    import tempfile

    from bench_train import parse_args

    from sections.ddp import section_ddp_efficiency as efficiency  # workers pickle by this name

    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--rounds", type=int, default=3)
    known, rest = extra.parse_known_args()
    args = parse_args(["ddp", *rest])
    os.environ.setdefault("REBM_NO_PROGRESS", "1")
    with tempfile.TemporaryDirectory(prefix="rebm_bench_") as tmp:
        args.workdir = args.workdir or tmp
        out = args.json
        args.json = os.path.join(args.workdir, "ddp_efficiency.json")
        result = efficiency(args, known.rounds)
        result["torch"] = torch.__version__
        text = json.dumps(result, indent=2)
        if out:
            with open(out, "w") as fh:
                fh.write(text)
        print(text)
