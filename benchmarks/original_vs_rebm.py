"""rebm side by side with the original DAT code (github:xuwangyin/DAT at fb2ffc7): the same
stage-2 training trajectory, the speed, the sample pass, and whole runs compared as
distributions (`run`), each code in its own process (both are `rebm`).

    python -m benchmarks.original_vs_rebm --original PATH trajectory [--write-reference FILE]
    python -m benchmarks.original_vs_rebm --original PATH speed [--device cuda] [--config cifar]
    python -m benchmarks.original_vs_rebm --original PATH samples [--device cuda]
    python -m benchmarks.original_vs_rebm --original PATH --workdir DIR run --seeds 5 \
        [--parallel 4] [--json benchmarks/original_run_twin.json]

PATH is a checkout of the original (or REBM_ORIGINAL). Its dependencies (einops, torchmetrics,
wandb, scikit-learn, omegaconf, timm) must be importable by this interpreter, or lie in
--original-pythonpath (REBM_ORIGINAL_PYTHONPATH), e.g. a folder made with
`pip install --target DIR einops torchmetrics`. The names its missing timm fork would provide are
bridged by benchmarks/original/timm_shim.py. Float32, TF32 off and cudnn.benchmark on are
pinned equal on both sides and printed. docs/performance.md "Against the original" has the
results and how they were taken.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

from benchmarks.original import common, samples, speed, trajectory

CONFIGS = {"cpu": common.SPEED_CPU, "cifar": common.SPEED_GPU_CIFAR,
           "imagenet": common.SPEED_GPU_IMAGENET}


def run_trajectory(args) -> int:
    spec = dict(common.TRAJECTORY, steps=args.steps or common.TRAJECTORY["steps"])
    job = common.Job(spec=spec, workdir=args.workdir, threads=1)
    trajectory.prepare(job)
    original = trajectory.run_original(job, args.original, args.original_pythonpath)
    runs = {t: trajectory.run_rebm(common.Job(**{**job.__dict__, "threads": t}))
            for t in (1, 2)}
    # rebm with the weights in NCHW, as the original's: CPU channels_last (rebm's default there)
    # rounds its convolutions differently, flips single ReLU signs and so moves the trajectory
    nchw = trajectory.run_rebm(job, "rebm_nchw", variant="eager_nchw")
    print("settings:", json.dumps({"original": original["describe"]["settings"],
                                   "rebm": runs[1]["describe"]["settings"]}))
    print("bridged by the shim:", ", ".join(original["describe"]["bridged"]))
    weights = {name: torch.load(r["final_weights"]) for name, r in
               (("original", original), ("rebm1", runs[1]), ("rebm2", runs[2]), ("nchw", nchw))}
    spread = {**trajectory.step_differences(runs[1]["steps"], runs[2]["steps"]),
              **trajectory.weight_differences(weights["rebm1"], weights["rebm2"])}
    spread_nchw = {**trajectory.step_differences(runs[1]["steps"], nchw["steps"]),
                   **trajectory.weight_differences(weights["rebm1"], weights["nchw"])}
    agreement = {**trajectory.step_differences(original["steps"], runs[1]["steps"]),
                 **trajectory.weight_differences(weights["original"], weights["rebm1"])}
    agreement_nchw = {**trajectory.step_differences(original["steps"], nchw["steps"]),
                      **trajectory.weight_differences(weights["original"], weights["nchw"])}
    tolerance = trajectory.tolerances([spread, spread_nchw], spec["batch_size"])
    report = {"T_original": trajectory.trajectory_T(original["steps"]),
              "T_changes_at_steps": trajectory.T_changes(original["steps"]),
              "spread_rebm_1_vs_2_threads": spread,
              "spread_rebm_channels_last_vs_nchw": spread_nchw, "tolerance": tolerance,
              "original_vs_rebm": agreement, "original_vs_rebm_nchw": agreement_nchw,
              "outside_tolerance": trajectory.check(agreement, tolerance)}
    print(json.dumps(report, indent=1))
    if args.write_reference:
        # the twin as `make test-dispatch` runs it: inputs and run under the forced dispatch
        forced_job = common.Job(**{**job.__dict__, "workdir": os.path.join(job.workdir, "forced")})
        trajectory.prepare(forced_job, trajectory.FORCED_DISPATCH)
        forced = trajectory.run_rebm(forced_job, "rebm_forced_dispatch",
                                     trajectory.FORCED_DISPATCH)
        weights["forced"] = torch.load(forced["final_weights"])
        write_reference(args.write_reference, spec, original, runs,
                        {"forced": forced, "nchw": nchw}, weights)
    return 1 if report["outside_tolerance"] else 0


def write_reference(path: str, spec: dict, original: dict, runs: dict, others: dict,
                    weights: dict) -> None:
    """The original's run, summarised (trajectory.summarize), with the spreads the tolerances
    come from: rebm at 1 vs 2 threads, rebm at 1 thread against rebm under the forced dispatch
    of `make test-dispatch`, and against rebm with NCHW weights as the original's (`others`:
    "forced", "nchw"; docs/design.md §7); and what the twin measures here."""
    final = {part: trajectory.summarize(weights["original"][part]) for part in ("model", "ema")}
    rebm1 = {part: trajectory.summarize(weights["rebm1"][part]) for part in ("model", "ema")}
    threads_spread = trajectory.twin_differences(runs[1]["steps"], rebm1, runs[2]["steps"],
                                                 weights["rebm2"])
    forced_spread = trajectory.twin_differences(runs[1]["steps"], rebm1, others["forced"]["steps"],
                                                weights["forced"])
    nchw_spread = trajectory.twin_differences(runs[1]["steps"], rebm1, others["nchw"]["steps"],
                                              weights["nchw"])
    native = trajectory.twin_differences(original["steps"], final, runs[1]["steps"],
                                         weights["rebm1"])
    reference = {
        "made_by": "python -m benchmarks.original_vs_rebm --original PATH trajectory "
                   f"--write-reference {path}",
        "original": "github:xuwangyin/DAT fb2ffc756da1f55321c1bbcbe0727a2e1de114c6",
        "machine": machine(), "spec": spec,
        "spread_rebm_1_vs_2_threads": threads_spread,
        "spread_forced_dispatch": forced_spread,
        "spread_channels_last_vs_nchw": nchw_spread,
        "twin_here_native_dispatch": native,
        "tolerance": trajectory.tolerances([threads_spread, forced_spread, nchw_spread],
                                           spec["batch_size"]),
        "steps": original["steps"], "final": final,
    }
    with open(path, "w") as fh:  # one line per top-level key: the numbers compact, the rest legible
        fh.write("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
                                    for k, v in reference.items()) + "\n}\n")
    print(f"reference written to {path}")


def machine() -> str:
    """The CPU model and the kernels ATen dispatches to, torch, cores (docs/design.md §7)."""
    import platform

    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh
                        if line.startswith("model name")), cpu)
    return (f"{cpu} (ATen {torch.backends.cpu.get_cpu_capability()}), torch "
            f"{torch.__version__}, {os.cpu_count()} cores, 1 thread per process")


def run_speed(args) -> int:
    spec = dict(CONFIGS[args.config], steps=args.warmup + args.rounds * args.steps)
    if args.quick:  # the same code paths at a fraction of the work: a smoke run, not a figure
        spec.update(T_start=2, T_cap=2, K=2, batch_size=8)
    job = common.Job(spec=spec, workdir=args.workdir, device=args.device, threads=args.threads)
    result = speed.compare_speed(job, args.original, args.original_pythonpath,
                                 rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                                 variants=tuple(args.variants))
    print(speed.format_table(result))
    print("settings:", json.dumps(result["settings"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


def run_samples(args) -> int:
    """The sample pass of the ImageNet row (benchmarks/original/samples.py), both codes."""
    spec = dict(samples.SAMPLES_IMAGENET, **(samples.QUICK if args.quick else {}))
    spec.update({k: v for k, v in (("num_samples", args.num_samples),
                                   ("num_workers", args.num_workers),
                                   ("sample_steps", args.steps), ("image_size", args.image_size),
                                   ("sample_batch", args.sample_batch)) if v is not None})
    job = common.Job(spec=spec, workdir=args.workdir, device=args.device, threads=args.threads)
    result = samples.compare_samples(job, args.original, args.original_pythonpath,
                                     rounds=args.rounds, warmup=args.warmup,
                                     variants=tuple(args.variants))
    print(samples.format_table(result))
    print("settings:", json.dumps(result["settings"]))
    print("timed on the original's side: evaluate_image_generation -> compute_fid with "
          "pytorch-fid and the Inception Score stubbed (stub calls over the run: "
          f"{json.dumps(result['describe']['original']['samples']['stubbed_calls'])})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


def run_twin(args) -> int:
    """Whole stage-2 runs of the scaled CIFAR recipe, `--seeds` a side (the original; rebm on
    one process and on two), compared as distributions (benchmarks/original/run_twin.py)."""
    import time

    from benchmarks.original import run_configs, run_data, run_stats
    from benchmarks.original import run_twin as twin

    spec = dict(run_configs.RUN)
    started = time.perf_counter()
    seeds = list(range(args.seeds))
    print(f"run-level twin: {len(seeds)} seeds x {', '.join(args.sides)} in {args.workdir}, "
          f"{args.parallel} at a time", flush=True)
    results = twin.run_all(spec, args.workdir, seeds, args.sides, args.original,
                           args.original_pythonpath, args.parallel)
    files = twin.prepare(args.workdir, spec)
    total_steps = spec["total_epochs"] * run_configs.steps_per_epoch(spec, files["counts"]["train"])
    features = run_data.FeatureNetwork(spec, files["stage1"])
    from rebm.data.files import load_digits

    reference, _ = features(load_digits(32, True).data.float() / 255)
    per_side = {side: [run_stats.run_quantities(spec, results[side][seed], total_steps,
                                                features, reference) for seed in seeds]
                for side in args.sides}
    table = run_stats.summarize(per_side, total_steps)
    if "original" in per_side:  # the rule as applied here against the files its loop wrote
        written = [results["original"][seed]["bestacc_writes"][-1] for seed in seeds]
        ruled = [run["bestacc_step"] for run in per_side["original"]]
        print(f"model_bestacc.pth, the original's last write per seed {written}, by the rule "
              f"{ruled}: {'the same' if written == ruled else 'DIFFERENT'}")
    seconds = time.perf_counter() - started
    print(run_stats.format_table(table, args.sides))
    print(f"the twin took {seconds / 60:.1f} min on {machine()} ({os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f} at the end)")
    if args.json:
        stored = {"made_by": "python -m benchmarks.original_vs_rebm --original PATH run "
                             f"--seeds {args.seeds}",
                  "original": "github:xuwangyin/DAT fb2ffc756da1f55321c1bbcbe0727a2e1de114c6",
                  "machine": machine(), "minutes": round(seconds / 60, 1),
                  "run_seconds": {side: [round(results[side][s]["seconds"]) for s in seeds]
                                  for side in args.sides},
                  "spec": spec, "total_steps": total_steps,
                  "evaluation_steps": run_configs.evaluation_steps(spec, total_steps),
                  "stage1_test_accuracy": files["stage1_test_accuracy"],
                  "runs": per_side, "table": table}
        with open(args.json, "w") as fh:
            fh.write("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}"
                                         for k, v in stored.items()) + "\n}\n")
        print(f"results written to {args.json}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--original", default=os.environ.get("REBM_ORIGINAL"),
                        help="a checkout of the original DAT code (default: $REBM_ORIGINAL)")
    parser.add_argument("--original-pythonpath",
                        default=os.environ.get("REBM_ORIGINAL_PYTHONPATH"),
                        help="extra import path for the original's dependencies")
    parser.add_argument("--workdir", default=None, help="shared files (default: a temp dir)")
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("trajectory", help="50 stage-2 steps on CPU, compared step by step")
    t.add_argument("--steps", type=int, default=None)
    t.add_argument("--write-reference", default=None, metavar="FILE")
    s = sub.add_parser("speed", help="the steps timed interleaved, medians of the rounds")
    s.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    s.add_argument("--config", default=None, choices=tuple(CONFIGS),
                   help="cpu (WRN-16-4, batch 32), cifar (WRN-34-10, batch 128), imagenet "
                        "(ResNet-50, 256 px); default: cpu on CPU, cifar on CUDA")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument("--steps", type=int, default=2, help="steps per side per round")
    s.add_argument("--warmup", type=int, default=1)
    s.add_argument("--variants", nargs="+", default=["eager", "default", "bf16"])
    s.add_argument("--json", default=None)
    s.add_argument("--quick", action="store_true",
                   help="T = K = 2, batch 8: checks that everything runs; its numbers are noise")
    m = sub.add_parser("samples", help="the ImageNet row's sample pass (50 images at 256 px, "
                       "14 steps), the original's PNG-writing path vs rebm's, interleaved")
    m.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    m.add_argument("--threads", type=int, default=2)
    m.add_argument("--rounds", type=int, default=5)
    m.add_argument("--warmup", type=int, default=1)
    m.add_argument("--num-samples", type=int, default=None, help="default 50")
    m.add_argument("--num-workers", type=int, default=None,
                   help="the original's loader workers and PNG threads (default 16, its "
                        "ImageNet FID template's data.num_workers)")
    m.add_argument("--steps", type=int, default=None,
                   help="L2 sampling steps (default 14, the ImageNet row's)")
    m.add_argument("--image-size", type=int, default=None, help="default 256")
    m.add_argument("--sample-batch", type=int, default=None, help="default 100")
    m.add_argument("--variants", nargs="+", default=list(samples.VARIANTS),
                   choices=samples.VARIANTS)
    m.add_argument("--json", default=None)
    m.add_argument("--quick", action="store_true",
                   help="64 px, 4 samples, 2 steps: checks that everything runs; noise")
    r = sub.add_parser("run", help="whole stage-2 runs of the scaled CIFAR recipe, several "
                       "seeds a side, compared as distributions")
    r.add_argument("--seeds", type=int, default=5)
    r.add_argument("--parallel", type=int, default=2, help="runs at a time")
    r.add_argument("--sides", nargs="+", default=["original", "rebm1", "rebm2"],
                   choices=("original", "rebm1", "rebm2"))
    r.add_argument("--json", default=None, metavar="FILE",
                   help="store the results, e.g. benchmarks/original_run_twin.json")
    args = parser.parse_args(argv)
    if not args.original:
        parser.error("give --original PATH (a checkout of github:xuwangyin/DAT) or set "
                     "REBM_ORIGINAL")
    if args.what == "speed" and args.config is None:
        args.config = "cifar" if args.device == "cuda" else "cpu"
    with tempfile.TemporaryDirectory(prefix="rebm_vs_original_") as tmp:
        args.workdir = args.workdir or tmp
        run = {"trajectory": run_trajectory, "speed": run_speed, "samples": run_samples,
               "run": run_twin}
        return run[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
