"""The whole training-speed benchmark in one command (`make bench`); see docs/performance.md.

    .venv/bin/python benchmarks/run_all.py [--quick] [--cores 2] [--out bench_out] [--only PREFIX ...]

Runs every section of benchmarks/bench_train.py in its own process (multi-rank sections spawn
their ranks with rebm.distributed.spawn, gloo on CPU), prints one table and writes all figures to
<out>/results.json (per-section logs in <out>/logs/). Figures are medians of several repetitions;
every ratio compares two measurements of the same invocation. Take final figures on an idle
machine: `--quick` (one or two repetitions) is a smoke run whose numbers are noise.
Default repetitions finish in under 10 minutes on an idle 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench_train.py")

PEER_STEP_S = 6.5  # original DAT code, WRN-16-4, batch 32, T = K = 10, 2-core CPU, 2 threads
TARGETS = {
    "ddp_efficiency": 0.90,  # images/s on 2 ranks x 1 thread / 1 rank x 2 threads, >=
    "eval_speedup": 1.6,  # 1 rank x 2 threads time / 2 ranks x 1 thread time, >=
    "resume_difference_s": 1.0,  # |resume at step 10,000 - resume at step 10|, <=
    "peer_ratio": 0.8,  # rebm dat_step / 6.5 s, <= (at least 20 % faster)
    "overhead_ratio": 1.05,  # loop step / minimal hand-written step, <=
}


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
        ("resume/quickstart", ["resume", *r(5, 1), *w(1, 1), *qs], one),
        ("resume/wrn", ["resume", *r(3, 1), *w(1, 1), *wrn], one),
        ("checkpoint/wrn", ["checkpoint", *r(5, 2), *w(1, 1), *wrn], one),
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
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=child_env(threads), stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout)
            code: Optional[int] = proc.returncode
        except subprocess.TimeoutExpired:
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


# ---------------------------------------------------------------------------------------------
# Summary and table
# ---------------------------------------------------------------------------------------------
def _get(results: dict, key: str, *path, default=None):
    value = results.get(key)
    for part in path:
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value


def summarize(results: dict) -> dict:
    s: Dict[str, dict] = {}
    for cfg in ("quickstart", "wrn"):
        ws1 = _get(results, f"ddp/{cfg}/ws1", "images_per_s")
        ws2 = _get(results, f"ddp/{cfg}/ws2", "images_per_s")
        if ws1 and ws2:
            s[f"ddp_efficiency/{cfg}"] = {"value": ws2 / ws1, "target": ">= 0.90",
                                         "met": ws2 / ws1 >= TARGETS["ddp_efficiency"],
                                         "ws1_images_per_s": ws1, "ws2_images_per_s": ws2}
        ratio = _get(results, f"steps/{cfg}", "overhead_ratio")
        if ratio:
            s[f"overhead/{cfg}"] = {"value": ratio, "target": "<= 1.05",
                                    "met": ratio <= TARGETS["overhead_ratio"],
                                    "paired": _get(results, f"steps/{cfg}",
                                                   "overhead_ratio_paired")}
        diff = _get(results, f"resume/{cfg}", "difference_s")
        if diff is not None:
            s[f"resume/{cfg}"] = {"value": diff, "target": "|diff| <= 1 s",
                                  "met": abs(diff) <= TARGETS["resume_difference_s"]}
    peer = results.get("peer/wrn", {})
    step = _get(results, "peer/wrn", "dat_step_s", "nchw")
    if step:
        best = min(peer["dat_step_s"].values())
        gflop, gemm = peer["step_gflop"], peer["gemm_gflops"]
        # judged on the default (NCHW, eager); the speed options are reported beside it
        s["peer"] = {"value": step / PEER_STEP_S, "dat_step_s": step, "peer_s": PEER_STEP_S,
                     "variants_s": peer["dat_step_s"],
                     "best_ratio": best / PEER_STEP_S,
                     "target": "<= 0.80 (<= 5.2 s)",
                     "met": step / PEER_STEP_S <= TARGETS["peer_ratio"],
                     # the FLOP rate each step time implies, against the machine's GEMM rate
                     "step_gflop": gflop, "gemm_gflops": gemm,
                     "achieved_gflops": gflop / best,
                     "peer_implied_gflops": gflop / PEER_STEP_S,
                     "target_implied_gflops": gflop / (TARGETS["peer_ratio"] * PEER_STEP_S)}
    e1, e2 = _get(results, "eval/ws1", "eval_s"), _get(results, "eval/ws2", "eval_s")
    e11 = _get(results, "eval/ws1t1", "eval_s")
    indep = _get(results, "eval/ws2_independent", "eval_s")
    if e1 and e2:
        s["eval_speedup"] = {"value": e1 / e2, "target": ">= 1.6",
                             "met": e1 / e2 >= TARGETS["eval_speedup"],
                             "ws1_s": e1, "ws2_s": e2, "ws1_1thread_s": e11,
                             "vs_1thread": e11 / e2 if e11 else None}
        if indep:
            # two ranks that each do the whole set concurrently take `indep`; a perfect split
            # of one set over them takes indep / 2: the best any 2-rank evaluation can do here
            s["eval_speedup"].update(independent_s=indep, ceiling=e1 / (indep / 2),
                                     contention_slowdown=indep / e11 if e11 else None,
                                     of_ceiling=(indep / 2) / e2)
    for name in ("quickstart", "wrn"):
        ratio = _get(results, "attack", "models", name, "ratio")
        if ratio:
            s[f"attack/{name}"] = {"value": ratio}
    return s


def _fmt(value, unit: str = "s", digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if unit == "s":
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f}{unit}"


def _mark(entry: Optional[dict]) -> str:
    if not entry or "met" not in entry:
        return ""
    return "  [target met]" if entry["met"] else "  [target MISSED]"


def table(results: dict, summary: dict, meta: dict) -> str:
    lines = []
    add = lines.append
    add(f"rebm training-speed benchmark | torch {meta['torch']} | {meta['cores']} cores "
        f"({meta['cpu']}) | {'QUICK smoke run (numbers are noise)' if meta['quick'] else 'default'}"
        f" | {meta['date']}")
    load = meta["loadavg_start"][0]
    if load > 0.5:
        add(f"WARNING: load average {load:.2f} at the start: other processes compete for the "
            "cores, so these figures (2-thread ones above all) are not representative.")
    add("")
    add(f"1. Step time breakdown: 1 process, {meta['cores']} threads, median s per optimizer "
        "step")
    cols = ("quickstart", "wrn")
    labels = {c: _get(results, f"breakdown/{c}", "label", default=c) for c in cols}
    for c in cols:
        add(f"   {c}: {labels[c]}")
    add(f"   {'piece':44s}" + "".join(f"{c:>16s}" for c in cols))
    rows = [
        ("data wait (num_workers=0)", "data_wait"),
        ("negative-sample attack (T PGD steps)", "neg_attack"),
        ("classifier attack (K PGD steps)", "clf_attack"),
        ("forward + backward (fused, 3B images)", "fwd_bwd"),
        ("optimizer step (+ zero_grad)", "optimizer"),
        ("EMA update", "ema"),
        ("bookkeeping (AUC, curriculum, consensus)", "bookkeeping"),
        ("logging + images + checkpoint, amortized", "logging_checkpoint_amortized"),
    ]
    for title, key in rows:
        add(f"   {title:44s}" + "".join(
            f"{_fmt(_get(results, f'breakdown/{c}', 'per_step_s', key)):>16s}" for c in cols))

    def comm(c):
        exp = _get(results, f"ddp/{c}/ws2", "exposed_allreduce_s")
        raw = _get(results, f"ddp/{c}/ws2", "raw_allreduce_s")
        return "n/a" if exp is None else f"{exp:.3f} / {raw:.3f}"

    add(f"   {'grad all-reduce, 2 ranks (exposed / raw)':44s}" + "".join(
        f"{comm(c):>16s}" for c in cols))
    add(f"   {'sum of pieces':44s}" + "".join(
        f"{_fmt(_get(results, f'breakdown/{c}', 'sum_of_pieces_s')):>16s}" for c in cols))
    add(f"   {'full loop step incl. data (measured)':44s}" + "".join(
        f"{_fmt(_get(results, f'breakdown/{c}', 'full_loop_step_s')):>16s}" for c in cols))
    for c in cols:
        ev = _get(results, f"breakdown/{c}", "per_event_s")
        iv = _get(results, f"breakdown/{c}", "intervals_imgs")
        if ev and iv:
            add(f"   {c} per event: metrics log {ev['metrics_log']:.3f} s every "
                f"{iv['metrics_log']} imgs, image grid {ev['image_log']:.3f} s every "
                f"{iv['image_log']}, checkpoint {ev['checkpoint']:.3f} s every {iv['checkpoint']}")
    add("")
    add("2. DDP efficiency: loop step, same global batch, 2 ranks x 1 thread vs 1 rank x 2 "
        "threads (gloo)")
    for c in cols:
        e = summary.get(f"ddp_efficiency/{c}")
        if e:
            add(f"   {c:12s} {e['ws1_images_per_s']:8.2f} -> {e['ws2_images_per_s']:8.1f}"
                f" images/s   efficiency {e['value']:.3f} (target >= 0.90){_mark(e)}")
        else:
            add(f"   {c:12s} n/a")
    add("")
    add("3. Attack step (input gradient only) / training forward+backward (parameter gradients)")
    for name in cols:
        m = _get(results, "attack", "models", name)
        if m:
            add(f"   {m['model']:16s} {m['image_size']:2d} px batch {m['batch']:3d}: attack "
                f"{m['attack_step_s'] * 1e3:8.1f} ms, fwd+bwd {m['fwd_bwd_s'] * 1e3:8.1f} ms, "
                f"ratio {m['ratio']:.3f} (paired {m['ratio_paired']:.3f})")
    add("")
    e = summary.get("eval_speedup")
    add("4. Evaluation (accuracy + robust accuracy, digits test set)")
    if e:
        n = _get(results, "eval/ws1", "n_test")
        add(f"   {n} images: 1 rank x 2 threads {e['ws1_s']:.3f} s, 2 ranks x 1 thread "
            f"{e['ws2_s']:.3f} s, speed-up {e['value']:.2f}x (target >= 1.6){_mark(e)}")
        if e.get("vs_1thread"):
            add(f"   reference: 1 rank x 1 thread {e['ws1_1thread_s']:.3f} s: speed-up of 2 ranks "
                f"over 1 at 1 thread per rank {e['vs_1thread']:.2f}x")
        if e.get("ceiling"):
            add(f"   ceiling: 2 ranks x 1 thread each evaluating the whole set at once take "
                f"{e['independent_s']:.3f} s ({e['contention_slowdown']:.2f}x one rank alone), so a perfect split takes {e['independent_s'] / 2:.3f} s: best possible "
                f"speed-up {e['ceiling']:.2f}x; rebm reaches {e['of_ceiling']:.0%} of it")
    else:
        add("   n/a")
    add("")
    add("5. Resume latency: restore (read_state + load) + build_train_data(start_step=k) + first"
        " batch")
    for c in cols:
        r = _get(results, f"resume/{c}", "at_step")
        if r:
            d = summary[f"resume/{c}"]
            add(f"   {c:10s} step 10: {r['10']['total']:.3f} s (read_state "
                f"{r['10']['read_state']:.3f})  step 10,000: {r['10000']['total']:.3f} s "
                f"(read_state {r['10000']['read_state']:.3f})  difference {d['value']:+.3f} s "
                f"(target |diff| <= 1 s){_mark(d)}")
    add("")
    c = results.get("checkpoint/wrn", {})
    add("6. Checkpoint (WRN-16-4 training state: model + optimizer + EMA + RNG + config)")
    if "save_training_state_s" in c:
        add(f"   {c['state_mib']:.1f} MiB: save_training_state {c['save_training_state_s']:.3f} s "
            f"(state_dict assembly {c['state_dict_assembly_s']:.3f} s, "
            f"{c['write_mib_per_s']:.0f} MiB/s incl. fsync); training is blocked "
            f"{c['training_blocked_s']:.3f} s per checkpoint (synchronous on rank 0, the other "
            f"ranks wait in the consensus); read_state {c['read_state_s']:.3f} s")
    else:
        add("   n/a")
    add("")
    add("7. Peak RSS per rank (MiB, ru_maxrss)")
    for key, value in results.items():
        rss = value.get("max_rss_mib") if isinstance(value, dict) else None
        if rss:
            add(f"   {key:24s} " + ", ".join(f"rank {i}: {v:.0f}" for i, v in enumerate(rss)))
    add("")
    p = summary.get("peer")
    add("8. Peer comparison: dat_step, WRN-16-4, 32 px, batch 32, T=10, K=10, fp32, frozen BN, "
        "SGD")
    if p and meta["quick"]:
        add(f"   --quick runs T = K = 2: no comparison (dat_step {p['dat_step_s']:.3f} s)")
    elif p:
        add(f"   rebm {p['dat_step_s']:.3f} s vs original {PEER_STEP_S} s: ratio {p['value']:.3f}"
            f" (target <= 0.80){_mark(p)}")
        labels = {"channels_last": "model.channels_last=true",
                  "compiled": "+ model.compile=true"}
        for name, label in labels.items():
            seconds = p["variants_s"].get(name)
            if seconds:
                add(f"   {label:29s} {seconds:.3f} s: ratio {seconds / PEER_STEP_S:.3f}")
        add(f"   the step is {p['step_gflop']:.0f} GFLOP (FlopCounterMode): rebm runs at "
            f"{p['achieved_gflops']:.0f} GFLOP/s at best; a float32 GEMM (2048^2) reaches "
            f"{p['gemm_gflops']:.0f} GFLOP/s; {PEER_STEP_S} s would need "
            f"{p['peer_implied_gflops']:.0f} GFLOP/s and the target "
            f"{p['target_implied_gflops']:.0f} GFLOP/s")
    else:
        add("   n/a")
    add("")
    add("9. Framework overhead: loop step (dat_step + EMA + AUC + consensus) / minimal PyTorch "
        "step")
    for c in cols:
        o = summary.get(f"overhead/{c}")
        st = results.get(f"steps/{c}", {})
        if o:
            add(f"   {c:12s} {st['loop_step_s']:.3f} s / {st['minimal_step_s']:.3f} s "
                f"= {o['value']:.3f} (paired {o['paired']:.3f}; target <= 1.05){_mark(o)}")
    failed = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    if failed:
        add("")
        add("FAILED sections: " + ", ".join(f"{k} ({results[k]['error']}, see "
                                           f"{results[k]['log']})" for k in failed))
    return "\n".join(lines)


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
