"""Sections `compile` (the first step of a compiled run: fresh, resumed without the run dir's
compile cache, resumed with it; and the graph count) and `evalshare` (the unit costs from which
run_all's summary estimates the share of wall time that periodic evaluation takes at the
shipped CIFAR configs' intervals)."""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import shutil
import time

import torch

from sections.common import (
    median,
    prefetch,
    section_result,
    single_process,
    timed,
)

# ---------------------------------------------------------------------------------------------
# compile: the first step of a restart, with and without <run_dir>/compile_cache
# ---------------------------------------------------------------------------------------------
ATTEMPTS = (
    # (name, run dir, local inductor cache): every attempt starts with an empty local cache,
    # as a job restarted on another node does; "cached" reuses the run dir of "first".
    ("first", "run_a", "local_1"),
    ("resumed_without_cache", "run_b", "local_2"),
    ("resumed_with_cache", "run_a", "local_3"),
)


def _compile_attempt(args, run_dir: str, queue) -> None:
    from rebm.distributed import compile_cache
    from sections.common import loop_step

    args = copy.copy(args)
    args.workdir = run_dir  # make_config puts the run dir (and the fake CIFAR) under workdir
    started = time.perf_counter()
    bench = single_process(args, ["model.compile=true"])
    built = time.perf_counter() - started
    batches = prefetch(bench, 1 + args.reps)
    cache = bench.parts.compile_cache
    first = loop_step(bench, batches[0])["total"]
    cache.after_step()  # what the loop calls after every step: saves the new graphs
    graphs_first = compile_cache.compiled_graphs()
    steady = [loop_step(bench, b)["total"] for b in batches[1:]]
    cache.after_step()
    queue.put({"build_s": built, "first_step_s": first, "steady_step_s": median(steady),
               "graphs_after_first_step": graphs_first,
               "recompiles_after_first_step": compile_cache.compiled_graphs() - graphs_first,
               "cache_artifacts_loaded": cache.loaded})


def section_compile(args) -> dict:
    """Each attempt in a fresh process (spawn), so nothing stays in memory between them."""
    ctx = mp.get_context("spawn")
    attempts = {}
    for name, run_dir, local in ATTEMPTS:
        local_dir = os.path.join(args.workdir, "compile_bench", local)
        shutil.rmtree(local_dir, ignore_errors=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = local_dir  # inherited by the spawned process
        queue = ctx.Queue()
        proc = ctx.Process(target=_compile_attempt,
                           args=(args, os.path.join(args.workdir, "compile_bench", run_dir),
                                 queue))
        proc.start()
        attempts[name] = queue.get(timeout=1200)
        proc.join()
    bench = single_process(args)
    return section_result("compile", args, bench, attempts=attempts)


# ---------------------------------------------------------------------------------------------
# evalshare: per-image unit costs on this machine
# ---------------------------------------------------------------------------------------------
def _per_image(fn, n: int, reps: int, device) -> float:
    fn()  # warm-up
    return median([timed(fn, device)[1] for _ in range(reps)]) / n


def _model_gflop(model_type: str, image_size: int = 32) -> float:
    """Forward GFLOP of one image (FlopCounterMode), to scale the measured model's costs."""
    from torch.utils.flop_counter import FlopCounterMode

    from rebm.models import build_model

    model = build_model(model_type, 10).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.rand(1, 3, image_size, image_size))
    return counter.get_total_flops() / 1e9


SHIPPED = ("experiments/cifar10/cifar10-dat-WideResNet34x10-T40-seed0.yaml",
           "experiments/cifar100/cifar100-dat-WideResNet34x10-T45-seed0.yaml")
CIFAR_TEST_IMAGES = 10_000


def shipped_eval_work(path: str) -> dict:
    """What one training interval and one evaluation of a shipped config consist of, counted in
    images and PGD steps (T at its curriculum maximum: the most training work per interval)."""
    from rebm.config import load_config
    from rebm.eval.metrics.accuracy import robust_eval_attack
    from sections.common import ROOT

    cfg = load_config(os.path.join(ROOT, path))
    log = cfg.image_log
    sweep = sweep_steps = 0
    if log.log_fid and log.adaptive_steps:
        candidates = log.step_sweep_range or range(max(1, log.num_steps - log.sweep_radius),
                                                   log.num_steps + log.sweep_radius + 1)
        sweep = len(list(candidates))
        sweep_steps = sum(candidates)
    return {"config": path, "model": cfg.model.model_type,
            "interval_images": cfg.intervals.n_imgs_per_evaluation_log,
            "T": cfg.method.attack.max_steps, "K": cfg.method.indist_attack_clf.max_steps,
            "test_images": CIFAR_TEST_IMAGES,
            "robust_steps": robust_eval_attack(cfg.evaluation).max_steps if cfg.eval.robust_eval else 0,
            "samples": log.num_samples, "sample_steps": log.num_steps,
            "fid_images": (log.num_samples + sweep * log.sweep_num_samples) * log.log_fid,
            "sweep_pgd_image_steps": sweep_steps * log.sweep_num_samples}


def section_evalshare(args) -> dict:
    """Seconds per image of: a training step (the loop's step / batch), an evaluation forward,
    one PGD step (forward + input gradient, what robust accuracy and sample generation repeat)
    and an Inception-v3 forward at 299 px (FID's features; random weights, same cost)."""
    import torchvision

    from rebm.attacks.pgd import pgd_attack
    from sections.common import loop_step

    bench = single_process(args)
    device, model = bench.runtime.device, bench.parts.raw_model
    batches = prefetch(bench, 1 + args.reps)
    loop_step(bench, batches[0])
    b = bench.cfg.schedule.batch_size
    train = median([loop_step(bench, mb)["total"] for mb in batches[1:]]) / b
    x, y = batches[0][0]["in"].images, batches[0][0]["in"].labels
    model.eval()
    with torch.no_grad():
        forward = _per_image(lambda: model(x), b, args.reps, device)
    attack = _per_image(lambda: pgd_attack(model, x, steps=1, step_size=0.1, objective="ce",
                                           y=y), b, args.reps, device)
    inception = torchvision.models.inception_v3(weights=None, aux_logits=False,
                                                init_weights=False).eval()
    x299 = torch.rand(8, 3, 299, 299)
    with torch.no_grad():
        fid_features = _per_image(lambda: inception(x299), 8, max(1, args.reps // 2), device)
    return section_result(
        "evalshare", args, bench, T=bench.parts.training_method.curriculum.T,
        K=bench.cfg.method.indist_attack_clf.max_steps, train_image_s=train, forward_image_s=forward,
        attack_step_image_s=attack, inception_image_s=fid_features,
        model_gflop={name: _model_gflop(name) for name in
                     (bench.cfg.model.model_type, "WideResNet34x10")},
        shipped=[shipped_eval_work(path) for path in SHIPPED])


# ---------------------------------------------------------------------------------------------
# breakeven: what `model.compile: auto` weighs (rebm.engine.compiling.REPAYING_STEPS)
# ---------------------------------------------------------------------------------------------
def section_breakeven(args) -> dict:
    """The compile's cost against the step time it saves, in one process: the eager and the
    compiled run built side by side; the compiled run's first step (compilation included) is
    timed once, then the steady steps of both, interleaved. compile_s = first compiled step -
    steady compiled step; saved_s = eager step - compiled step; the run repays the compile
    after compile_s / saved_s steps."""
    from rebm.checkpoint.run_directory import RunDirectory
    from sections.common import loop_step

    # a fresh local inductor cache, as on a new node: a warm one (an earlier section or run on
    # this machine) would hide most of the compilation
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(args.workdir, "breakeven_inductor")
    shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
    eager = single_process(args, ["model.compile=false"])
    shutil.rmtree(RunDirectory(eager.cfg.run.run_dir).file(RunDirectory.COMPILE_CACHE),
                  ignore_errors=True)
    compiled = single_process(args, ["model.compile=true"])
    device = eager.runtime.device
    batches = prefetch(eager, 1 + args.warmup + args.reps)
    loop_step(eager, batches[0])  # eager's own first step (allocator, oneDNN primitives)
    first = timed(lambda: loop_step(compiled, batches[0]), device)[1]
    times = {"eager": [], "compiled": []}
    for rep, batch in enumerate(batches[1:]):
        order = ("eager", "compiled") if rep % 2 == 0 else ("compiled", "eager")
        for name in order:
            seconds = loop_step(eager if name == "eager" else compiled, batch)["total"]
            if rep >= args.warmup:
                times[name].append(seconds)
    step = {name: median(values) for name, values in times.items()}
    compile_s, saved_s = first - step["compiled"], step["eager"] - step["compiled"]
    return section_result(
        "breakeven", args, eager, first_compiled_step_s=first, step_s=step, step_all_s=times,
        compile_s=compile_s, saved_per_step_s=saved_s,
        break_even_steps=compile_s / saved_s if saved_s > 0 else None)
