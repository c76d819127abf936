"""Section `attack`: one PGD step (gradient w.r.t. the input only) vs one training forward +
backward with parameter gradients, same batch, eval-mode (frozen-BN) model, interleaved
repetitions; benchmarks/bench_attack.py prints the same comparison for more models."""

from __future__ import annotations

import statistics

import torch
from bench_attack import interleaved_times, paired_ratio, step_fns

from rebm.models import build_model
from sections.common import peak_rss_mib

MODELS = (("quickstart", "WideResNet10x1", 16, 64), ("wrn", "WideResNet16x4", 32, 32))


def section_attack(args) -> dict:
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    out = {"section": "attack", "threads": args.threads, "reps": args.reps, "models": {}}
    for name, model_type, size, batch in MODELS:
        torch.manual_seed(0)
        model = build_model(model_type, 10).to(device).eval()
        x = torch.rand(batch, 3, size, size, device=device)
        y = torch.randint(0, 10, (batch,), device=device)
        fns = step_fns(model, x, y)
        times = interleaved_times({k: fns[k] for k in ("attack", "train")}, args.reps,
                                  args.warmup, device)
        attack, train = statistics.median(times["attack"]), statistics.median(times["train"])
        out["models"][name] = {
            "model": model_type, "image_size": size, "batch": batch,
            "attack_step_s": attack, "fwd_bwd_s": train, "ratio": attack / train,
            "ratio_paired": paired_ratio(times),
        }
    out["max_rss_mib"] = [peak_rss_mib()]
    return out
