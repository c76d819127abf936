"""Section `fused`: the two attacks of one micro-batch (negatives PGD_T and the classifier
batch's PGD_K^CE, `rebm.methods.dat.dat.dat_attacks` as DAT.micro_loss calls it: eval mode,
the run's autocast) run separately and as one fused pass (`fuse_attacks`), eager and compiled,
interleaved in one process; medians and the ratio fused / separate (below 1: fusion pays)."""

from __future__ import annotations

import functools
from typing import Callable, Dict, List

import torch
from torch import nn

from rebm.data import CLASSIFIER, OUTDIST
from rebm.methods.dat.dat import dat_attacks
from sections.common import median, prefetch, section_result, single_process, timed


class _SeparateView(nn.Module):
    """The model behind a forward of its own: torch.compile keeps its graphs per code object, so
    the two compiled variants get a cache each (otherwise the separate attacks would run the
    fused pass's dynamic-batch graph, the most recently compiled one, instead of their own)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)


class _FusedView(_SeparateView):
    def forward(self, x):  # a second code object: the fused pass's own graph cache
        return self.model(x)


def section_fused(args) -> dict:
    bench = single_process(args)  # eager (the sections pin model.compile=false)
    cfg, ctx, device = bench.cfg, bench.ctx, bench.runtime.device
    raw = bench.parts.raw_model
    T, K = bench.parts.training_method.curriculum.T, cfg.method.indist_attack_clf.max_steps
    attacked = {"eager": ctx.attacked, "compiled_separate": torch.compile(_SeparateView(raw)),
                "compiled_fused": torch.compile(_FusedView(raw))}
    variants: Dict[str, Callable] = {}
    for mode in ("eager", "compiled"):
        for fuse in (False, True):
            model = attacked["eager" if mode == "eager" else
                             f"compiled_{'fused' if fuse else 'separate'}"]
            variants[f"{mode}_{'fused' if fuse else 'separate'}"] = (
                lambda mb, model=model, fuse=fuse: dat_attacks(
                    model, cfg.method, T, mb, fuse, cfg.schedule.batch_size))
    n = max(1, args.warmup) + args.reps  # at least one warm-up: it compiles
    batches = [step[0] for step in prefetch(bench, n)]
    times: Dict[str, List[float]] = {name: [] for name in variants}
    ctx.attacked.eval()
    for rep in range(n):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for name in order:
            with ctx.autocast():
                _, seconds = timed(functools.partial(variants[name], batches[rep]), device)
            if rep >= n - args.reps:
                times[name].append(seconds)
    attack_s = {name: median(values) for name, values in times.items()}
    ratio = {mode: attack_s[f"{mode}_fused"] / attack_s[f"{mode}_separate"]
             for mode in ("eager", "compiled")}
    paired = {mode: median([f / s for f, s in zip(times[f"{mode}_fused"],
                                                  times[f"{mode}_separate"], strict=True)])
              for mode in ("eager", "compiled")}
    mb = batches[0]
    return section_result(
        "fused", args, bench, T=T, K=K, per_stream_batch=mb[OUTDIST.name].images.shape[0],
        classifier_batch=mb[CLASSIFIER.name].images.shape[0], attacks_s=attack_s,
        attacks_all_s=times, fused_over_separate=ratio, fused_over_separate_paired=paired)
