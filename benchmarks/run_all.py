"""The whole training-speed benchmark in one command (`make bench`); see docs/performance.md.

    .venv/bin/python benchmarks/run_all.py [--quick] [--cores 2] [--out bench_out] [--only PREFIX ...]

Runs every section of benchmarks/bench_train.py in its own process (multi-rank sections spawn
their ranks with rebm.distributed.spawn, gloo on CPU), prints one table and writes all figures to
<out>/results.json (per-section logs in <out>/logs/). Figures are medians of several repetitions;
every ratio compares two measurements of the same invocation. Take final figures on an idle
machine: `--quick` (one or two repetitions) is a smoke run whose numbers are noise.
Default repetitions finish in about 30 minutes on an idle 2-core CPU (the compile section
compiles three times).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from bench_summary import summarize, table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench_train.py")

# --quick: the WRN-16-4 sections run with T = K = 2 instead of 10 (same code paths, a fifth of
# the work), so the smoke run stays short; its figures, the peer ratio above all, mean nothing.
QUICK_WRN = ["--set", "attack.max_steps=2", "indist_attack_clf.max_steps=2"]


def jobs(quick: bool, cores: int) -> List[tuple]:
    """(key, bench_train.py arguments, threads per process) in the order they run."""
    def r(full: int, smoke: int) -> List[str]:
        return ["--reps", str(smoke if quick else full)]

    def w(full: int, smoke: int) -> List[str]:
        return ["--warmup", str(smoke if quick else full)]

    wrn = ["--config", "wrn", *(QUICK_WRN if quick else [])]
    qs = ["--config", "quickstart"]
    one, half = cores, max(1, cores // 2)
    return [
        ("breakdown/quickstart", ["breakdown", *qs, *r(5, 1), *w(2, 1)], one),
        ("breakdown/wrn", ["breakdown", *r(3, 1), *w(1, 1), *wrn], one),
        ("steps/quickstart", ["steps", *qs, *r(20, 2), *w(3, 1)], one),
        ("steps/wrn", ["steps", *r(3, 1), *w(1, 1), *wrn], one),
        ("peer/wrn", ["peer", *r(2, 1), *w(1, 1), *wrn], one),
        # against the original DAT code (REBM_ORIGINAL; reported as skipped without it)
        ("original/wrn", ["original", *r(5, 1), *w(1, 1), *wrn], one),
        ("fused/wrn", ["fused", *r(4, 1), *w(1, 1), *wrn], one),
        ("ddp/quickstart/ws1", ["ddp", "--world-size", "1", *r(20, 2), *w(3, 1), *qs], one),
        ("ddp/quickstart/ws2", ["ddp", "--world-size", "2", *r(20, 2), *w(3, 1), *qs], half),
        ("ddp/wrn/ws1", ["ddp", "--world-size", "1", *r(3, 2), *w(1, 1), *wrn], one),
        ("ddp/wrn/ws2", ["ddp", "--world-size", "2", *r(3, 2), *w(1, 1), *wrn], half),
        ("attack", ["attack", *r(20, 2), *w(3, 1)], one),
        ("eval/ws1", ["eval", "--world-size", "1", *r(5, 1), *w(1, 1)], one),
        ("eval/ws2", ["eval", "--world-size", "2", *r(5, 1), *w(1, 1)], half),
        # reference: 1 rank x 1 thread (the speed-up of 2 ranks over 1 at equal threads/rank)
        ("eval/ws1t1", ["eval", "--world-size", "1", *r(3, 1), *w(1, 1)], half),
        # ceiling: 2 ranks x 1 thread, each evaluating the whole set at once (no split)
        ("eval/ws2_independent", ["eval", "--world-size", "2", "--independent", *r(3, 1),
                                  *w(1, 1)], half),
        # precision/recall's k-NN sharded: 1 and 2 processes x 1 thread (the section starts both)
        ("prc", ["prc", *r(3, 1), *w(1, 0)], half),
        ("resume/quickstart", ["resume", *r(5, 1), *w(1, 1), *qs], one),
        ("resume/wrn", ["resume", *r(3, 1), *w(1, 1), *wrn], one),
        ("checkpoint/wrn", ["checkpoint", *r(5, 2), *w(1, 1), *wrn], one),
        # three fresh compilations (tens of seconds each on CPU); --quick: the small model
        ("compile", ["compile", *r(2, 1), *(qs if quick else wrn)], one),
        ("evalshare/wrn", ["evalshare", *r(3, 1), *wrn], one),
        ("sampling", ["sampling", *r(3, 1), *w(1, 1)], one),
        # model.compile: auto's trade: one compilation against the time each step saves
        ("breakeven/quickstart", ["breakeven", *qs, *r(8, 2), *w(2, 1)], one),
        ("breakeven/wrn", ["breakeven", *r(3, 1), *w(1, 1), *wrn], one),
    ]


def child_env(threads: int) -> Dict[str, str]:
    env = dict(os.environ)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               WANDB_MODE="disabled", REBM_NO_PROGRESS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_job(key: str, argv: List[str], threads: int, workdir: str, out_dir: str,
            timeout: float) -> dict:
    slug = key.replace("/", "_")
    json_path = os.path.join(workdir, f"{slug}.json")
    log_path = os.path.join(out_dir, "logs", f"{slug}.log")
    cmd = [sys.executable, BENCH, *argv, "--threads", str(threads), "--workdir", workdir,
           "--json", json_path]
    started = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        # its own process group: a timeout ends the section with every process it started
        # (spawned ranks, compile attempts), not just the section's own process
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(threads), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: Optional[int] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    elapsed = time.perf_counter() - started
    if code == 0 and os.path.exists(json_path):
        with open(json_path) as fh:
            result = json.load(fh)
        status = "ok"
    else:
        result = {"error": "timed out" if code is None else f"exit code {code}",
                  "log": log_path}
        status = result["error"]
    result["wall_s"] = elapsed
    result["command"] = " ".join(["python", os.path.relpath(BENCH, ROOT), *argv,
                                  "--threads", str(threads)])
    print(f"  {key:24s} {status:14s} {elapsed:6.1f} s", flush=True)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="one or two repetitions per figure: a 1-3 minute smoke run")
    parser.add_argument("--cores", type=int, default=2,
                        help="threads of the 1-rank runs; 2-rank runs use cores/2 each")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench_out"))
    parser.add_argument("--only", nargs="*", default=None, metavar="PREFIX",
                        help="run only the sections whose key starts with one of these")
    parser.add_argument("--timeout", type=float, default=None,
                        help="per-section time limit in s (default 600, quick 300)")
    args = parser.parse_args(argv)
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    timeout = args.timeout or (300.0 if args.quick else 600.0)

    import torch

    meta = {
        "torch": torch.__version__, "python": platform.python_version(),
        "cores": args.cores, "cpu": platform.processor() or platform.machine(),
        "available_cores": len(os.sched_getaffinity(0)), "quick": args.quick,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg_start": os.getloadavg(),
    }
    selected = [j for j in jobs(args.quick, args.cores)
                if not args.only or any(j[0].startswith(p) for p in args.only)]
    print(f"running {len(selected)} sections (logs in {os.path.join(args.out, 'logs')})",
          flush=True)
    started = time.perf_counter()
    results: Dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rebm_bench_") as workdir:
        for key, argv_job, threads in selected:
            results[key] = run_job(key, argv_job, threads, workdir, args.out, timeout)
    meta["total_s"] = time.perf_counter() - started
    meta["loadavg_end"] = os.getloadavg()
    summary = summarize(results)
    text = table(results, summary, meta)
    print()
    print(text)
    print(f"\ntotal {meta['total_s']:.0f} s; load average at start {meta['loadavg_start'][0]:.2f},"
          f" at end {meta['loadavg_end'][0]:.2f}")
    path = os.path.join(args.out, "results.json")
    with open(path, "w") as fh:
        json.dump({"meta": meta, "summary": summary, "sections": results}, fh, indent=2)
    with open(os.path.join(args.out, "results.txt"), "w") as fh:
        fh.write(text + "\n")
    print(f"results written to {path}")
    return 1 if any("error" in v for v in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
