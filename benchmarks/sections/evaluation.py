"""Section `eval`: Evaluator.evaluate_all_ranks (accuracy + robust accuracy) on the digits test set on W ranks;
--independent: every rank evaluates all of it at once (the contention ceiling)."""

from __future__ import annotations

import torch

from rebm import distributed as rd
from rebm.distributed import Runtime
from sections.common import (
    make_config,
    median,
    rss_per_rank,
    run_ranks,
    slowest_rank,
    timed,
    write_json,
)


def _eval_worker(opts: dict) -> None:
    from rebm.config import eval_batch_size
    from rebm.eval.evaluator import Evaluator
    from rebm.eval.registry import standard_metrics
    from rebm.models import model_from_config

    runtime = rd.setup_distributed(use_ddp=True, backend=opts["backend"], device=opts["device"])
    torch.set_num_threads(opts["threads"])
    try:
        cfg = make_config("quickstart", opts["workdir"], [*opts["set"], "robust_eval=true"],
                          opts["device"])
        torch.manual_seed(cfg.schedule.rand_seed)
        model = model_from_config(cfg.model, cfg.data).to(runtime.device)
        metrics = standard_metrics(cfg.evaluation, samples=False)
        # independent: every rank evaluates the whole test set on its own (no sharding, no
        # collective inside), all starting together: how much the ranks slow each other down
        # on this machine's shared cores, caches and memory (the ceiling of any 2-rank split).
        eval_runtime = Runtime(device=runtime.device) if opts["independent"] else runtime
        # one per run: test data built once
        evaluator = Evaluator(cfg.evaluation, eval_runtime, metrics)
        times = []
        for rep in range(opts["warmup"] + opts["reps"]):
            rd.barrier(runtime)
            result, seconds = timed(lambda: evaluator.evaluate_all_ranks(model).values,
                                    runtime.device)
            if rep >= opts["warmup"]:
                times.append(seconds)
        per_rep = slowest_rank(runtime, times)
        rss = rss_per_rank(runtime)
        if runtime.is_main:
            write_json(opts["json"], {
                "section": "eval", "world_size": runtime.world_size,
                "independent": opts["independent"],
                "threads_per_rank": opts["threads"], "n_test": result["n_test"],
                "robust_eval_steps": cfg.eval.robust_eval_steps or cfg.method.indist_attack_clf.max_steps,
                "eval_batch_per_rank": eval_batch_size(cfg.schedule, cfg.eval, eval_runtime.world_size),
                "eval_s": median(per_rep), "eval_all_s": per_rep,
                "test_acc": result["test_acc"],
                "robust_test_acc": result.get("robust_test_acc"),
                "max_rss_mib": rss,
            })
    finally:
        rd.teardown(runtime)


def section_eval(args) -> dict:
    opts = dict(workdir=args.workdir, set=list(args.set), device=args.device,
                backend=args.backend, threads=args.threads, warmup=args.warmup, reps=args.reps,
                independent=args.independent, json=args.json + ".worker")
    return run_ranks(_eval_worker, opts, args.world_size)
