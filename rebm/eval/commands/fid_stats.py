"""Write FID reference statistics (a pytorch-fid .npz) of a config's in-distribution data.

`python -m rebm.eval.fid_stats CONFIG [key=value ...] --out PATH.npz [--split train|test]
[--num-images N] [--recipe fid_score2|test]` writes `mu` and `sigma` of the Inception pool3
features of the first N images (default: all) of the split; pytorch-fid reads it
(`np.load(PATH)['mu']`). Point `image_log.data_dir` at it. The recipe says how the images are
read at S = `data.image_size` (docs/evaluation.md, "The reference statistics"):
- `fid_score2`: CenterCrop(min side) + bilinear Resize((S, S)), how the only statistics code in
  the original (its vendored pytorch-fid/src/pytorch_fid/fid_score2.py:146-153) reads files for
  256 px; the default at S = 256;
- `test`: rebm's test transform (full-resolution images: bicubic Resize floor(S / 0.875) +
  CenterCrop S; stored images such as CIFAR's: as they are); the default otherwise.
Runs as one process or under torchrun (`torchrun --nproc_per_node=N -m rebm.eval.fid_stats ...`):
the images are sharded over the ranks and the statistics are those of one process. The Inception
weights come from the same place, and are checked the same way, as for FID; REBM_FID_FEATURES
names a stand-in feature network instead (rebm ships one: rebm.eval.standin:features). The file
records the network (`features`: verified Inception, unverified with its digest, or the stand-in)
and the recipe (`recipe`); an FID with another network refuses it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, Dict, List, Optional

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader

from rebm import cli
from rebm.config import eval_batch_size
from rebm.config.views import EvaluationSection
from rebm.data.augmentations import build_augmentation, center_square_resize
from rebm.data.indexing import eval_chunks
from rebm.data.pipeline import indist_source, loader_workers
from rebm.data.sources import ImageDataset
from rebm.distributed import Runtime, print_line, setup_logging
from rebm.distributed.collectives import on_main
from rebm.eval.features.fid import (
    FIDError,
    feature_extractor,
    moments_statistics_all_ranks,
    write_statistics,
)
from rebm.eval.features.network import STANDIN, feature_network

RECIPES = ("fid_score2", "test")
ORIGINAL_SIZE = 256  # the size fid_score2.py resizes to, and the recipe's default there

LOGGER = logging.getLogger("rebm")


def default_recipe(image_size: int) -> str:
    """fid_score2's at 256 px (the only recipe in the original's code), rebm's test transform
    at other sizes (fid_score2 resizes to 256 only)."""
    return "fid_score2" if image_size == ORIGINAL_SIZE else "test"


def recipe_text(recipe: str, image_size: int, full_images: bool) -> str:
    """How the images were read, as the .npz records it."""
    if recipe == "fid_score2":
        return (f"fid_score2: CenterCrop(min side) + Resize(({image_size}, {image_size}), "
                "bilinear), as the original's pytorch-fid/src/pytorch_fid/fid_score2.py")
    if full_images:
        return (f"test: Resize({image_size * 8 // 7}, bicubic) + CenterCrop({image_size}), "
                "rebm's test transform")
    return f"test: the stored {image_size} px images, rebm's test transform"


def statistics_images(evaluation: EvaluationSection, split: str, recipe: str):
    """(dataset of (float [0, 1] image, label), recipe text) of the split read by `recipe`."""
    source = indist_source(evaluation.data, split)
    size = evaluation.data.image_size
    transform = (center_square_resize(size) if recipe == "fid_score2"
                 else build_augmentation("test", size, source.full_images))
    return ImageDataset(source, transform), recipe_text(recipe, size, source.full_images)


def dataset_statistics_all_ranks(evaluation: EvaluationSection, runtime: Runtime,
                                 split: str = "train",
                                 num_images: Optional[int] = None, batch_size: Optional[int] = None,
                                 recipe: Optional[str] = None):
    """(mu, sigma, n, recipe text) of the features of the first `num_images` images of the
    in-distribution `split` read by `recipe` (default: `default_recipe`), the same on every
    rank. Chunks of `batch_size` images are spread over the ranks (chunk k on rank k % W).
    Every rank must call this."""
    dataset, recipe = statistics_images(evaluation, split,
                                        recipe or default_recipe(evaluation.data.image_size))
    n = len(dataset) if num_images is None else min(num_images, len(dataset))
    if n < 2:
        raise FIDError(f"FID statistics need at least 2 images; the {split} split of "
                       f"{evaluation.data.indist_dataset} gives {n}")
    batch_size = batch_size or eval_batch_size(evaluation.schedule, evaluation.eval, runtime.world_size)
    features = feature_extractor(runtime.device, evaluation.image_log)
    mine = [i for chunk in eval_chunks(n, batch_size, runtime.rank, runtime.world_size)
            for i in chunk]
    loader = DataLoader(dataset, batch_size=batch_size, sampler=mine, drop_last=False,
                        num_workers=loader_workers(evaluation.data, runtime))
    # Every chunk but the last one overall is full, so the loader's batches are the chunks.
    batches = (features(x.to(runtime.device)) for x, _ in loader)
    with torch.no_grad():
        mu, sigma = moments_statistics_all_ranks(batches, runtime)
    return mu, sigma, n, recipe


def fid_stats_all_ranks(cfg, runtime: Runtime, args) -> Dict[str, Any]:
    setup_logging(runtime)
    out = args.out if args.out.endswith(".npz") else args.out + ".npz"
    network = feature_network(cfg.image_log)
    feature_extractor(runtime.device, cfg.image_log)  # fail first
    mu, sigma, n, recipe = dataset_statistics_all_ranks(cfg.evaluation, runtime, args.split,
                                                        args.num_images, recipe=args.recipe)
    summary = {"out": os.path.abspath(out), "split": args.split, "num_images": n,
               "dims": int(mu.shape[0]), "features": network.describe(), "recipe": recipe,
               "world_size": runtime.world_size}
    what = {STANDIN: f"STAND-IN FID statistics ({network.spec}, not Inception)",
            "unverified": f"FID statistics of UNVERIFIED Inception weights (sha256 "
                          f"{str(network.sha256)[:8]}...)"}.get(network.kind,
                                                                "FID statistics (Inception)")

    def write() -> None:
        write_statistics(out, mu, sigma, network.describe(), recipe)
        LOGGER.info("%s of %d %s images written to %s (recipe %s)", what, n, args.split, out,
                    recipe)
        sys.stderr.flush()
        print_line(json.dumps(summary))

    on_main(runtime, write, f"write {out}")
    return summary


def build_parser():
    parser = cli.build_parser("rebm.eval.fid_stats", __doc__.splitlines()[0])
    parser.add_argument("--out", required=True,
                        help="the .npz to write (mu, sigma, and the network's name)")
    parser.add_argument("--split", choices=("train", "test"), default="train",
                        help="in-distribution split (default: train)")
    parser.add_argument("--num-images", type=int, default=None,
                        help="use the first N images of the split (default: all)")
    parser.add_argument("--recipe", choices=RECIPES, default=None,
                        help="how the images are read: fid_score2 (CenterCrop(min side) + "
                             "Resize((S, S)), the original's; the default at 256 px) or test "
                             "(rebm's test transform; the default at other sizes)")
    return parser


def check_args(args, cfg) -> None:
    if args.num_images is not None and args.num_images < 2:
        raise FIDError(f"--num-images {args.num_images}: FID statistics need at least 2 images")
    feature_network(cfg.image_log)  # missing or unpinned weights: before any process starts


@record
def main(argv: Optional[List[str]] = None) -> int:
    return cli.run_entry(build_parser(), argv, fid_stats_all_ranks, prepare=check_args)


if __name__ == "__main__":
    sys.exit(main())
