"""Section `prc`: precision/recall's k-NN computation (rebm/eval/features/knn.py, sharded over
the ranks) on 1 process x 1 thread and on 2 processes x 1 thread (rebm.distributed.spawn, gloo
on CPU), the same feature rows on both: 5000 generated + 5000 real random 2048-d float32 rows
(10 000 rows in all, Inception pool's width; two draws of one Gaussian, so precision and recall are
near 0.5 and no early stop helps), k = 3. Each layout runs `rounds` times,
alternating which goes first (the machine's load drifts); a run times `--reps` computations
after `--warmup` ones (per repetition the slowest rank). It reports the medians, their ratio
(2 processes / 1 process; the target of issue 31 is <= 0.6), the precision and recall of each
layout (equal), and per rank the peak RSS and how much the computation raised it (its working
memory beyond the feature rows, which exist before it starts).

Alone: `python benchmarks/sections/fidelity.py [--rounds N] [--rows N] [bench_train options]`."""

from __future__ import annotations

import os
import resource
import sys
from typing import Dict, List

if __name__ == "__main__":  # run as a script: the benchmarks folder is the import root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from rebm import distributed as rd
from rebm.eval.features.knn import precision_recall_all_ranks
from sections.common import (
    gather_floats,
    median,
    rss_per_rank,
    run_ranks,
    slowest_rank,
    timed,
    write_json,
)

DIMS = 2048  # torch-fidelity's Inception pool features
NEIGHBORHOOD = 3


def _features(rows: int):
    """`rows` generated and `rows` real float32 rows, the same on every rank (seeded)."""
    generator = torch.Generator().manual_seed(0)
    generated = torch.randn(rows, DIMS, generator=generator)
    real = torch.randn(rows, DIMS, generator=generator)  # the same law: P and R near 0.5
    return generated, real


def _prc_worker(opts: dict) -> None:
    runtime = rd.setup_distributed(use_ddp=True, backend="gloo", device="cpu")
    torch.set_num_threads(1)
    try:
        generated, real = _features(opts["rows"])
        before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        times, values = [], None
        for rep in range(opts["warmup"] + opts["reps"]):
            rd.barrier(runtime)
            values, seconds = timed(lambda: precision_recall_all_ranks(  # noqa: B023
                runtime, generated, real, NEIGHBORHOOD))
            if rep >= opts["warmup"]:
                times.append(seconds)
        grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kib
        grown = [row[0] for row in gather_floats(runtime, [grown_kib / 1024.0])]
        step = slowest_rank(runtime, times)
        rss = rss_per_rank(runtime)
        if runtime.is_main:
            write_json(opts["json"], {"world_size": runtime.world_size, "seconds": step,
                                      "precision": values[0], "recall": values[1],
                                      "peak_rss_mib": rss, "working_mib": grown})
    finally:
        rd.teardown(runtime)


def section_prc(args, rounds: int = 2, rows: int = 5000) -> dict:
    """Median seconds of the sharded precision/recall on 1 and on 2 processes (1 thread each)
    and their ratio."""
    runs: Dict[int, List[dict]] = {1: [], 2: []}
    for index in range(rounds):
        for world in ((1, 2) if index % 2 == 0 else (2, 1)):
            opts = dict(rows=rows, warmup=args.warmup, reps=args.reps,
                        json=f"{args.json}.prc{world}.worker")
            runs[world].append(run_ranks(_prc_worker, opts, world))
    seconds = {w: median([s for run in runs[w] for s in run["seconds"]]) for w in (1, 2)}
    values = {w: [(run["precision"], run["recall"]) for run in runs[w]] for w in (1, 2)}
    features_mib = 2 * rows * DIMS * 4 / 2**20
    return {"section": "prc", "rows_generated": rows, "rows_real": rows, "dims": DIMS,
            "neighborhood": NEIGHBORHOOD, "threads_per_rank": 1, "rounds": rounds,
            "reps_per_run": args.reps, "warmup": args.warmup,
            "seconds_1rank": seconds[1], "seconds_2ranks": seconds[2],
            "ratio_2ranks_to_1": seconds[2] / seconds[1],
            "precision_recall_1rank": values[1][0], "precision_recall_2ranks": values[2][0],
            "same_values": len({*values[1], *values[2]}) == 1,
            "feature_rows_mib": features_mib,
            "peak_rss_mib_1rank": max(run["peak_rss_mib"][0] for run in runs[1]),
            "peak_rss_mib_2ranks": max(max(run["peak_rss_mib"]) for run in runs[2]),
            "working_mib_1rank": max(run["working_mib"][0] for run in runs[1]),
            "working_mib_2ranks": max(max(run["working_mib"]) for run in runs[2]),
            "all_seconds": {str(w): [run["seconds"] for run in runs[w]] for w in (1, 2)}}


if __name__ == "__main__":
    import argparse
    import json
    import tempfile

    from bench_train import parse_args

    from sections.fidelity import section_prc as prc  # workers pickle by this name

    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--rounds", type=int, default=2)
    extra.add_argument("--rows", type=int, default=5000, help="generated rows (as many real)")
    known, rest = extra.parse_known_args()
    args = parse_args(["ddp", *rest])
    os.environ.setdefault("REBM_NO_PROGRESS", "1")
    with tempfile.TemporaryDirectory(prefix="rebm_bench_") as tmp:
        args.workdir = args.workdir or tmp
        out = args.json
        args.json = os.path.join(args.workdir, "prc.json")
        result = prc(args, known.rounds, known.rows)
        result["torch"] = torch.__version__
        text = json.dumps(result, indent=2)
        if out:
            with open(out, "w") as fh:
                fh.write(text)
        print(text)
