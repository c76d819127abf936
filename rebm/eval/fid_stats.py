"""Write FID reference statistics (a pytorch-fid .npz) of a config's in-distribution data.

`python -m rebm.eval.fid_stats CONFIG [key=value ...] --out PATH.npz [--split train|test]
[--num-images N]` writes `mu` and `sigma` of the Inception pool3 features of the first N images
(default: all) of the split, loaded by rebm's data loading at `data.image_size` without
augmentation, as the samples are generated; pytorch-fid reads it (`np.load(PATH)['mu']`). Point
`image_log.data_dir` at it. Runs as one process or under torchrun (`torchrun --nproc_per_node=N
-m rebm.eval.fid_stats ...`): the images are sharded over the ranks and the statistics are those
of one process. The Inception weights come from the same place as for FID (docs/evaluation.md);
REBM_FID_FEATURES names a stand-in feature network instead (rebm ships one:
REBM_FID_FEATURES=rebm.eval.standin:features); the file then says so (`features` in the .npz
names the network, as does the console line), and only runs with the same stand-in use it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader

from rebm import cli
from rebm.config import eval_batch_size
from rebm.data import load_indist
from rebm.data.pipeline import loader_workers
from rebm.data.sampling import eval_chunks
from rebm.distributed import Runtime, print_line, setup_logging
from rebm.distributed.collectives import on_main
from rebm.eval.features.fid import (
    FEATURES_ENV,
    INCEPTION_WEIGHTS_FILE,
    STANDIN_SPEC,
    FIDError,
    feature_extractor,
    feature_network_name,
    hub_weights_path,
    moments_statistics,
)

LOGGER = logging.getLogger("rebm")


def dataset_statistics(cfg, runtime: Runtime, split: str = "train",
                       num_images: Optional[int] = None, batch_size: Optional[int] = None):
    """(mu, sigma, n) of the features of the first `num_images` images of the in-distribution
    `split`, the same on every rank. Chunks of `batch_size` images are spread over the ranks
    (chunk k on rank k % W). Every rank must call this."""
    dataset = load_indist(cfg, split, "test")
    n = len(dataset) if num_images is None else min(num_images, len(dataset))
    if n < 2:
        raise FIDError(f"FID statistics need at least 2 images; the {split} split of "
                       f"{cfg.data.indist_dataset} gives {n}")
    batch_size = batch_size or eval_batch_size(cfg, runtime.world_size)
    features = feature_extractor(runtime.device, cfg.image_log.inception_weights)
    mine = [i for chunk in eval_chunks(n, batch_size, runtime.rank, runtime.world_size)
            for i in chunk]
    loader = DataLoader(dataset, batch_size=batch_size, sampler=mine, drop_last=False,
                        num_workers=loader_workers(cfg, runtime))
    # Every chunk but the last one overall is full, so the loader's batches are the chunks.
    batches = (features(x.to(runtime.device)) for x, _ in loader)
    with torch.no_grad():
        mu, sigma = moments_statistics(batches, runtime)
    return mu, sigma, n


def save_statistics(path: str, mu: np.ndarray, sigma: np.ndarray) -> None:
    """Write the .npz through a temporary file and os.replace (never a half-written file)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp.npz")
    np.savez(tmp, mu=mu, sigma=sigma, features=np.array(feature_network_name()))
    os.replace(tmp, path)


def run(cfg, runtime: Runtime, args) -> Dict[str, Any]:
    setup_logging(runtime)
    out = args.out if args.out.endswith(".npz") else args.out + ".npz"
    feature_extractor(runtime.device, cfg.image_log.inception_weights)  # fail first
    mu, sigma, n = dataset_statistics(cfg, runtime, args.split, args.num_images)
    summary = {"out": os.path.abspath(out), "split": args.split, "num_images": n,
               "dims": int(mu.shape[0]), "features": feature_network_name(),
               "world_size": runtime.world_size}
    what = (f"STAND-IN FID statistics ({os.environ[FEATURES_ENV]}, not Inception)"
            if os.environ.get(FEATURES_ENV) else "FID statistics (Inception)")

    def write() -> None:
        save_statistics(out, mu, sigma)
        LOGGER.info("%s of %d %s images written to %s", what, n, args.split, out)
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
    return parser


def require_feature_network(cfg) -> None:
    """Statistics are always features of a network, whatever `image_log.log_fid` says: the
    Inception weights, or the stand-in that REBM_FID_FEATURES names."""
    if os.environ.get(FEATURES_ENV):
        return  # a stand-in; a name that does not import fails with its own line
    configured = cfg.image_log.inception_weights
    if os.path.isfile(configured or hub_weights_path()):
        return
    from pytorch_fid.inception import FID_WEIGHTS_URL

    found = (f"image_log.inception_weights '{configured}' does not exist" if configured else
             f"there are no Inception weights at {hub_weights_path()}")
    raise FIDError(
        f"FID statistics are Inception features and {found}: put {INCEPTION_WEIGHTS_FILE} "
        f"(from {FID_WEIGHTS_URL}) there or set image_log.inception_weights=PATH; for a smoke "
        f"run without them, {FEATURES_ENV}={STANDIN_SPEC} computes STAND-IN statistics (not "
        "Inception numbers; only FIDs computed with the same stand-in use them)")


def check_args(args, cfg) -> None:
    if args.num_images is not None and args.num_images < 2:
        raise FIDError(f"--num-images {args.num_images}: FID statistics need at least 2 images")
    require_feature_network(cfg)  # before any process starts its work


@record
def main(argv: Optional[List[str]] = None) -> int:
    return cli.run_entry(build_parser(), argv, run, prepare=check_args)


if __name__ == "__main__":
    sys.exit(main())
