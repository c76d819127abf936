"""The one generation pass that every sample metric shares, in bounded memory.

Each rank generates its chunks of samples (chunk k = samples [k·B, (k+1)·B), on rank k % W; B is
the evaluation batch), hands every chunk to every sample metric (which computes its features on
the spot and keeps only what its value needs: feature sums, feature rows, the grid's first
images) and drops it. Memory per rank is one chunk plus the metrics' running state, whatever
`image_log.num_samples` is; no rank ever holds every sample.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from rebm.config.datasets import indist_root_files
from rebm.config.views import EvaluationSection
from rebm.data.indexing import eval_chunks
from rebm.distributed.logs import progress
from rebm.distributed.signals import stop_points_all_ranks
from rebm.eval.metric import EvalContext, EvalError, Metric
from rebm.eval.sampling.generation import (
    NOISE_SEEDS,
    SampleGenerator,
    SeedImages,
    sampling_mode,
    seed_blur_kernel_size,
)


def seed_source(evaluation: EvaluationSection, resources: Dict[str, Any]):
    """The samples' seed images of `evaluation` (rebm.eval.sampling.generation.SeedImages),
    opened once per Evaluator and kept in its `resources` (SeedImageError, one line, when
    unusable)."""
    log, blur = evaluation.image_log, seed_blur_kernel_size(evaluation)
    key = f"seeds {log.seed_images} {evaluation.data.image_size} {evaluation.schedule.rand_seed} {blur}"
    if key not in resources:
        resources[key] = SeedImages(log.seed_images, evaluation.data.image_size,
                                    evaluation.schedule.rand_seed, evaluation, blur_kernel_size=blur)
    return resources[key]


def stream_samples_all_ranks(ctx: EvalContext, seeds, sinks: Sequence[Any], num_samples: int,
                             num_steps: Optional[int] = None, what: str = "samples") -> None:
    """Generate samples 0..num_samples-1 from `seeds` chunk by chunk (this rank's chunks) and
    feed each chunk to every sink (anything with `update(SampleChunk)`). `num_steps`: PGD
    steps (default image_log.num_steps). Its only collectives are the stop points (a stop asked
    for ends it: rebm.distributed.signals); the sinks' `finish_all_ranks` combines the ranks.
    Every rank calls this."""
    rt = ctx.runtime
    generate = SampleGenerator(ctx.model, ctx.evaluation, rt, seeds, num_steps)
    chunks = eval_chunks(num_samples, ctx.batch_size, rt.rank, rt.world_size)
    stops = stop_points_all_ranks(rt, len(chunks))
    for index, chunk in enumerate(progress(chunks, rt, what, total=len(chunks))):
        stops.check_all_ranks(index)
        samples = generate(torch.arange(chunk.start, chunk.stop, dtype=torch.int64))
        for sink in sinks:
            sink.update(samples)
        del samples  # the chunk's images go before the next chunk is generated


def run_sample_pass_all_ranks(ctx: EvalContext, seeds, metrics: List[Metric]
                              ) -> List[Dict[str, Any]]:
    """The generation pass for the sample metrics, then each metric's results (every rank calls
    this). A metric may fix the number of PGD steps first (FID's adaptive sweep)."""
    chosen = [s for s in (m.generation_steps_all_ranks() for m in metrics) if s is not None]
    if len(set(chosen)) > 1:
        raise EvalError(f"sample metrics chose different step counts {sorted(set(chosen))}")
    stream_samples_all_ranks(ctx, seeds, metrics, ctx.evaluation.image_log.num_samples,
                             chosen[0] if chosen else None)
    return [metric.finish_all_ranks() for metric in metrics]


def sample_settings(evaluation: EvaluationSection) -> Dict[str, Any]:
    """How the samples are drawn and quantised (part of every sample metric's settings, so of
    its cache key): what the samples depend on, not why. Whether they are conditional, not the
    setting that decided it: eval.unconditional_samples=true and logsumexp_sampling=true draw
    the same samples (the run's log line says which setting decided)."""
    log = evaluation.image_log
    unconditional, _ = sampling_mode(evaluation)
    return {"num_samples": log.num_samples, "conditional": not unconditional,
            "pixels": evaluation.eval.sample_pixels,
            "num_steps": log.num_steps, "step_size": log.step_size, "eps": log.eps,
            "norm": log.norm, "seed_images": log.seed_images,
            "seed_blur_kernel_size": seed_blur_kernel_size(evaluation),
            "seed": evaluation.schedule.rand_seed,
            # with FID in the pass, its adaptive sweep picks the steps of every sample metric
            "step_sweep": ({"range": log.step_sweep_range, "radius": log.sweep_radius,
                            "num_samples": log.sweep_num_samples}
                           if log.adaptive_steps else None)}


def sample_files(evaluation: EvaluationSection) -> Dict[str, Optional[str]]:
    """The files the samples are generated from: the seed file or folder, and the dataset root
    that 'gaussian' seeds are fitted to."""
    seeds = evaluation.image_log.seed_images
    if seeds == "gaussian":
        return indist_root_files(evaluation.data)
    return {} if seeds in NOISE_SEEDS else {"image_log.seed_images": seeds}


def describe_samples(settings: Dict[str, Any], steps: Any = None) -> str:
    """'500 conditional samples, 40 PGD steps (L2, step 1, eps inf) from noise, floor pixels'."""
    kind = "conditional" if settings["conditional"] else "unconditional"
    steps = settings["num_steps"] if steps is None else steps
    blur = settings.get("seed_blur_kernel_size") or 0
    blurred = f" blurred {blur}x{blur}" if blur > 1 else ""
    return (f"{settings['num_samples']} {kind} samples, {steps} PGD steps ({settings['norm']}, "
            f"step {settings['step_size']:g}, eps {settings['eps']:g}) from "
            f"{settings['seed_images']}{blurred}, {settings.get('pixels', 'round')} pixels")
