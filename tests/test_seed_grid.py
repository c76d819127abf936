"""The sample grid and the seed grid (issue 39), as the original's compute_fid writes them
(rebm/eval/eval_utils.py:434-551 at fb2ffc7): for each of the first min(10, C) classes its first
10 samples, class by class, in make_grid(nrow=10, padding=1, normalize=True) saved by
to_pil_image; the seed grid shows, in the same places, the seeds those samples started from.
rebm names them samples/gen_samples.png and samples/seed_samples.png.

The entry point runs on the bundled digits on 1 and 2 real processes (a random WideResNet):
both grids are the same bytes, and pixel for pixel the original's grids of the same float
samples and seeds."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from rebm.config import load_config
from rebm.distributed import Runtime
from rebm.eval.sampling.generation import SeedImages, grid_indices
from tests.helpers import REPO, base_env, run_command, torchrun_cmd

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.numbers]

CONFIG = str(REPO / "experiments" / "quickstart" / "digits.yaml")
N_SAMPLES = 120  # more than the grid's 100: samples 100-119 are in no grid
BATCH = 8  # evaluation chunks of 8: the grid's samples come from both ranks
OVERRIDES = ["image_log.num_steps=2", f"image_log.num_samples={N_SAMPLES}",
             # blurred seeds: the seed grid must show them blurred, as the ascent got them
             "image_log.blur_fid_seeds=true", "image_log.blur_kernel_size=3",
             f"per_device_eval_batch_size={BATCH}", "robust_eval=false"]


def _original_choice(num_samples: int, num_classes: int) -> list:
    """The sample indices of the original's grids, in grid order: sample i (label i % C) is
    kept when its class is one of the first min(10, C) and that class holds fewer than 10 yet;
    the grid lists the classes one after the other (eval_utils.py:430-509)."""
    shown = min(10, num_classes)
    by_class = {c: [] for c in range(shown)}
    for i in range(num_samples):
        kept = by_class.get(i % num_classes)
        if kept is not None and len(kept) < 10:
            kept.append(i)
    return [i for c in range(shown) for i in by_class[c]]


def _original_grid(images: torch.Tensor) -> np.ndarray:
    """The pixels of the original's grid PNG of these float images (eval_utils.py:517-549)."""
    from torchvision.transforms.functional import to_pil_image
    from torchvision.utils import make_grid

    return np.asarray(to_pil_image(make_grid(images, nrow=10, padding=1, normalize=True)))


def _png(path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image)


def test_the_grids_show_the_samples_the_original_chooses():
    for num_classes in (1, 2, 3, 10, 13, 1000):
        for num_samples in (0, 1, 7, 25, 99, 100, 101, 150, 9010):
            assert grid_indices(num_samples, num_classes, 100) == \
                _original_choice(num_samples, num_classes), (num_samples, num_classes)
    # eval.grid_num_samples other than 100: ceil(n / 10) classes, at most n images
    assert grid_indices(1000, 10, 25) == [*range(0, 100, 10), *range(1, 101, 10), 2, 12, 22, 32,
                                          42]
    assert grid_indices(1000, 10, 0) == []


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_seed_grid_beside_the_sample_grid_on_1_and_2_processes(tmp_path):
    from rebm.eval.evaluator import load_eval_model
    from rebm.eval.sampling.samples import seed_source
    from rebm.models import build_model, dataset_stats
    from tests.standins import generate_samples

    torch.manual_seed(0)
    mean, std = dataset_stats("digits")
    ckpt = tmp_path / "model.pth"
    torch.save(build_model(load_config(CONFIG).model.model_type, 10, mean=mean,
                           std=std).state_dict(), ckpt)
    folders = {}
    for nproc in (1, 2):
        out = tmp_path / f"w{nproc}"
        args = [CONFIG, f"model.ckpt_path={ckpt}", f"run_dir={out}", *OVERRIDES,
                "--samples", "--no-ece"]
        cmd = ([sys.executable, "-m", "rebm.eval.evaluate", *args] if nproc == 1
               else torchrun_cmd("rebm.eval.evaluate", args, 2))
        result = run_command(cmd, timeout=180, env=base_env()).assert_ok()
        assert f"sample and seed grids saved to {out / 'samples'}" in result.output
        folders[nproc] = out / "samples"
    assert not (folders[1] / "samples.png").exists()  # rebm's former name
    for name in ("gen_samples.png", "seed_samples.png"):
        assert (folders[2] / name).read_bytes() == (folders[1] / name).read_bytes(), name

    cfg = load_config(CONFIG, [f"model.ckpt_path={ckpt}", *OVERRIDES])
    model = load_eval_model(cfg.model, cfg.data, cfg.ema.use_ema, Runtime())
    samples, _ = generate_samples(model, cfg, batch_size=BATCH)
    seeds = seed_source(cfg.evaluation, {})(torch.arange(N_SAMPLES))
    order = _original_choice(N_SAMPLES, 10)
    assert order[:3] == [0, 10, 20] and len(order) == 100  # a row is a class
    gen, seed = _png(folders[1] / "gen_samples.png"), _png(folders[1] / "seed_samples.png")
    assert gen.shape == seed.shape == (1 + 10 * 17, 1 + 10 * 17, 3)
    assert np.array_equal(gen, _original_grid(samples[order]))
    assert np.array_equal(seed, _original_grid(seeds[order]))
    unblurred = SeedImages(cfg.image_log.seed_images, 16, cfg.schedule.rand_seed, cfg.evaluation)
    assert not np.array_equal(seed, _original_grid(unblurred(torch.tensor(order))))
