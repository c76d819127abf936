"""The speed comparison: the original's step and rebm's, each in its own worker process, on the
same weights and batches, timed interleaved (rounds alternate the order), medians of the rounds.

Rows: the original's step (its loop body at T fixed); rebm "eager" (float32, no compile,
attacks in two passes); rebm "default" (float32, what a long run gets: `model.compile: auto`,
`fuse_attacks: auto`); rebm "bf16" (the default with amp bf16, an extra row). Per row: ms per
step, the ratio to the original, GFLOP per step (FlopCounterMode over one whole step of that
code), the rate that implies against the device's peak (CPU: the GEMM rate measured here; GPU:
the datasheet's, named), and peak memory against rebm's `--check` memory plan.
"""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional

import torch

from benchmarks.original import common, sides

# Datasheet dense peaks (TFLOP/s) by precision, for the GPUs the project is lent: H100 SXM and
# H200 (the same compute). float32 without TF32 is the CUDA-core rate.
DATASHEET_TFLOPS = {"H100": {"float32": 67.0, "bf16": 989.0},
                    "H200": {"float32": 67.0, "bf16": 989.0}}


def device_peak(device: str, precision: str) -> Optional[dict]:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name(0)
    for key, peaks in DATASHEET_TFLOPS.items():
        if key in name:
            return {"name": f"{name} datasheet {precision}", "gflops": peaks[precision] * 1e3}
    return None


def start_all(job: common.Job, checkout: str, extra_path: Optional[str],
              variants: List[str]) -> Dict[str, sides.SideProcess]:
    procs = {"original": sides.start_original(job, checkout, extra_path)}
    for variant in variants:
        procs[variant] = sides.start_rebm(common.Job(**{**job.__dict__, "variant": variant}),
                                          f"rebm_{variant}")
    return procs


def interleaved(procs: Dict[str, sides.SideProcess], rounds: int, steps: int,
                warmup: int) -> Dict[str, List[float]]:
    """Seconds per step of each side, one figure per round (the mean of its `steps` steps);
    even rounds run the sides in one order, odd rounds in the reverse order."""
    names, first = list(procs), 0
    for name in names:  # warm-up (and, for compiled variants, compilation)
        procs[name].request("time_steps", first=0, count=warmup)
    first = warmup
    per_round: Dict[str, List[float]] = {name: [] for name in names}
    for index in range(rounds):
        for name in (names if index % 2 == 0 else names[::-1]):
            seconds = procs[name].request("time_steps", first=first, count=steps)
            per_round[name].append(sum(seconds) / len(seconds))
        first += steps
    return per_round


def compare_speed(job: common.Job, checkout: str, extra_path: Optional[str] = None,
                  rounds: int = 5, steps: int = 2, warmup: int = 1,
                  variants=("eager", "default", "bf16")) -> dict:
    """The whole comparison on job.device; returns the table's numbers."""
    from benchmarks.original.trajectory import prepare

    prepare(job)
    procs = start_all(job, checkout, extra_path, list(variants))
    try:
        setup = {name: p.request("prepare_timing") for name, p in procs.items()}
        describe = {name: p.request("describe") for name, p in procs.items()}
        per_round = interleaved(procs, rounds, steps, warmup)
        gflop = {"original": procs["original"].request("flops")}
        if "eager" in procs:
            gflop["rebm"] = procs["eager"].request("flops")
        memory = {name: p.request("peak_memory") for name, p in procs.items()}
        gemm = procs[variants[0]].request("gemm_gflops") if job.device == "cpu" else None
    finally:
        for p in procs.values():
            p.close()
    return table(job, per_round, gflop, memory, setup, describe, gemm)


def table(job, per_round, gflop, memory, setup, describe, gemm) -> dict:
    median = {name: statistics.median(v) for name, v in per_round.items()}
    rows = {}
    for name, seconds in median.items():
        flops = gflop["original"] if name == "original" else gflop.get("rebm")
        precision = "bf16" if name == "bf16" else "float32"
        peak = ({"name": "GEMM rate measured here (float32)", "gflops": gemm} if gemm
                else device_peak(job.device, precision))
        rows[name] = {
            "ms_per_step": 1e3 * seconds, "ratio_to_original": seconds / median["original"],
            "rounds_ms": [1e3 * s for s in per_round[name]],
            "gflop_per_step": flops,
            "achieved_gflops": flops / seconds if flops else None,
            "fraction_of_peak": flops / seconds / peak["gflops"] if flops and peak else None,
            "peak": peak, "memory_mib": memory[name], **setup[name],
        }
    return {"device": job.device, "threads": job.threads, "spec": job.spec, "rows": rows,
            "settings": {name: d["settings"] for name, d in describe.items()},
            "bridged": describe["original"].get("bridged")}


def format_table(result: dict) -> str:
    s = result["spec"]
    lines = [f"{s['model']}, {s['image_size']} px, batch {s['batch_size']}, T={s['T_cap']}, "
             f"K={s['K']}, {result['device']}, {result['threads']} threads",
             f"{'row':10s} {'ms/step':>9s} {'x orig':>7s} {'GFLOP':>7s} {'GFLOP/s':>8s} "
             f"{'of peak':>8s} {'peak MiB':>9s} {'plan MiB':>9s}"]
    for name, r in result["rows"].items():
        # CUDA: peak allocated; CPU: peak RSS above the process's RSS before its model existed
        mem = r["memory_mib"].get("max_cuda_mib",
                                  r["memory_mib"]["max_rss_mib"] - r.get("baseline_rss_mib", 0))
        plan = r.get("memory_plan_mib")

        def fmt(value, spec):
            return format(value, spec) if value is not None else "-"
        lines.append(f"{name:10s} {r['ms_per_step']:9.0f} {r['ratio_to_original']:7.3f} "
                     f"{fmt(r['gflop_per_step'], '7.1f')} {fmt(r['achieved_gflops'], '8.1f')} "
                     f"{fmt(r['fraction_of_peak'], '8.2f')} {mem:9.0f} {fmt(plan, '9.0f')}")
    peak = next((r["peak"] for r in result["rows"].values() if r["peak"]), None)
    if peak:
        lines.append(f"peak: {peak['name']}, {peak['gflops']:.0f} GFLOP/s")
    return "\n".join(lines)
