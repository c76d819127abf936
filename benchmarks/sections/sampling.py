"""Section `sampling`: images/s of the sample pass (rebm's SampleGenerator: seed images, then a
fixed number of PGD steps on f_y, as evaluation and FID generate them) at 32 px and 224 px,
against the attack roofline of this machine: the images/s the same PGD steps would reach if
every FLOP of their forward + input gradient ran at the rate of the machine's best dense
matrix product (`gemm_gflops`). The ratio says how much of the hardware the pass uses."""

from __future__ import annotations

import copy

import torch

from rebm.config import load_config
from rebm.distributed import Runtime
from rebm.distributed.parallel import resolve_channels_last
from rebm.models import model_from_config
from sections.common import median, peak_rss_mib, timed
from sections.peer import gemm_gflops

# (name, model, image size, classes, batch): the CIFAR-shaped model of the `wrn` config and the
# ImageNet ResNet-50 at the 224 px its table uses (ImageNet samples themselves run at 256 px).
MODELS = (("32px", "WideResNet16x4", 32, 10, 32), ("224px", "ResNet50ImageNet", 224, 1000, 8))
STEPS = 5  # PGD steps per sample (fixed; the paper's configs use 20-100, the rate is per step)


def attack_step_gflop(model: torch.nn.Module, x: torch.Tensor) -> float:
    """GFLOP of one PGD step on one image (forward + input gradient), by FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    model = copy.deepcopy(model)
    x = x[:1].clone().requires_grad_(True)
    with FlopCounterMode(display=False) as counter:
        model(x).logsumexp(1).sum().backward(inputs=[x])  # the input gradient only, as PGD
    return counter.get_total_flops() / 1e9


def _sample_pass(name: str, model_type: str, size: int, classes: int, batch: int, args,
                 gemm: float) -> dict:
    from rebm.eval.passes import eval_mode
    from rebm.eval.sampling.generation import SampleGenerator
    from rebm.eval.sampling.samples import seed_source

    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    cfg = load_config(None, [f"model.model_type={model_type}", f"data.image_size={size}",
                             f"data.num_classes={classes}", "image_log.seed_images=noise",
                             f"image_log.num_steps={STEPS}", *args.set])
    torch.manual_seed(0)
    model = model_from_config(cfg.model, cfg.data)
    if resolve_channels_last(cfg.model.channels_last, device, cfg.distributed.amp):
        model = model.to(memory_format=torch.channels_last)
    model = model.to(device).eval()
    generate = SampleGenerator(model, cfg.evaluation, Runtime(device=device),
                               seed_source(cfg.evaluation, {}))
    chunks = [torch.arange(i * batch, (i + 1) * batch) for i in range(args.warmup + args.reps)]
    with eval_mode(model):
        times = [timed(lambda c=c: generate(c), device)[1] for c in chunks][args.warmup:]
    per_image = attack_step_gflop(model, generate.seeds(chunks[0]).to(device))
    images_s = batch / median(times)
    roofline = gemm / (STEPS * per_image)
    return {"model": model_type, "image_size": size, "batch": batch, "steps": STEPS,
            "chunk_s": times, "images_s": images_s, "attack_step_gflop_per_image": per_image,
            "roofline_images_s": roofline, "of_roofline": images_s / roofline}


def section_sampling(args) -> dict:
    torch.set_num_threads(args.threads)
    gemm = gemm_gflops()
    passes = {name: _sample_pass(name, model, size, classes, batch, args, gemm)
              for name, model, size, classes, batch in MODELS}
    return {"section": "sampling", "threads": args.threads, "reps": args.reps,
            "gemm_gflops": gemm, "passes": passes, "max_rss_mib": [peak_rss_mib()]}
