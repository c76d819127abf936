"""Section `original`: rebm's step against the original DAT code's (github:xuwangyin/DAT at
fb2ffc7) on the same weights and batches, each in its own process, interleaved, medians of the
rounds (benchmarks/original/speed.py; the user command is `python -m benchmarks.original_vs_rebm
--original PATH speed`). CPU: WideResNet-16-4, batch 32, T = K = 10. Needs a checkout of the
original in REBM_ORIGINAL (and REBM_ORIGINAL_PYTHONPATH for its dependencies when this
environment lacks them); without one the section reports that it was skipped and why."""

from __future__ import annotations

import os

from sections.common import ROOT  # noqa: F401  (puts the repository on sys.path)


def section_original(args) -> dict:
    from benchmarks.original import common, speed  # after sections.common set the path

    checkout = os.environ.get("REBM_ORIGINAL")
    if not checkout:
        return {"section": "original", "skipped": "REBM_ORIGINAL is not set (a checkout of "
                "github:xuwangyin/DAT at fb2ffc7)"}
    device = "cuda" if args.device == "cuda" else "cpu"
    base = common.SPEED_GPU_CIFAR if device == "cuda" else common.SPEED_CPU
    warmup = max(1, args.warmup)  # compiles rebm's default variant
    spec = dict(base, steps=warmup + 2 * args.reps)
    if any(item.startswith("attack.max_steps=") for item in args.set):  # --quick: T = K = 2
        spec.update(T_start=2, T_cap=2, K=2)
    job = common.Job(spec=spec, workdir=os.path.join(args.workdir, "original"), device=device,
                     threads=args.threads)
    result = speed.compare_speed(job, checkout, os.environ.get("REBM_ORIGINAL_PYTHONPATH"),
                                 rounds=args.reps, steps=2, warmup=warmup)
    print(speed.format_table(result), flush=True)
    return {"section": "original", "threads": args.threads, "reps": args.reps, **result}
