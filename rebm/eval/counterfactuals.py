"""Counterfactual explanations: how a test image must change for the model to see another class.

Each of the first `num_images` test images is moved by targeted PGD ascent on the logit of every
other class (or of `num_targets` of them: the classes y+1, y+2, ... mod K), with the generation
threat model by default (`image_log`: L2 normalised-gradient steps, radius, step count). For each
(image, target) the model's softmax probability of the target is the confidence reached; the
share of counterfactuals classified as their target is the success rate. With per-class FID
statistics (`fid_stats`, a path with `{label}`, made by `python -m rebm.eval.counterfactuals
CONFIG --class-stats TEMPLATE`), the counterfactuals toward class c are compared with class c's
real images by FID, class by class; classes without a statistics file are left out.

Files (rank 0, when a folder is given): `<folder>/<position>.png`, one grid per source image (one
tile per class in class order, the source image in the tile of its own class; with
`num_targets` set, the source then its counterfactuals in target order), and
`<folder>/per_class.json` (confidence, success and FID per target class).

Sharded like every evaluation: sources in fixed chunks, chunk k on rank k % W, results gathered
by position, so the numbers are the same on any number of processes.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from rebm.attacks.pgd import pgd_attack
from rebm.data.ood_sets import FixedImageSet, indist_test_set
from rebm.distributed import Runtime
from rebm.distributed.collectives import decide_on_main, on_main
from rebm.distributed.logs import progress
from rebm.distributed.parallel import unwrap
from rebm.eval.accuracy import eval_mode
from rebm.eval.fid import (
    FIDError,
    feature_extractor,
    feature_network_name,
    feature_problems,
    feature_statistics,
    frechet_distance,
    load_reference,
    standin_key,
    to_8bit,
)
from rebm.eval.metric import TEST_SET, Metric
from rebm.eval.ood import chunk_loader, gather_by_position
from rebm.eval.test_set import test_indices, test_set_settings

LOGGER = logging.getLogger("rebm")


@dataclass(frozen=True)
class CounterfactualSettings:
    """What `evaluate_counterfactuals` computes (the `eval.counterfactual_*` fields)."""

    num_images: int = 10
    num_targets: Optional[int] = None  # None: every other class
    steps: int = 20
    step_size: float = 0.1
    eps: float = math.inf
    norm: str = "L2"
    fid_stats: Optional[str] = None  # per-class reference statistics, a path with {label}
    inception_weights: Optional[str] = None


def targets_per_image(num_classes: int, num_targets: Optional[int] = None) -> int:
    return num_classes - 1 if num_targets is None else min(num_targets, num_classes - 1)


def target_classes(labels: Tensor, num_classes: int, num_targets: Optional[int] = None
                   ) -> Tensor:
    """(B, m) targets of B images: y+1, ..., y+m (mod K), m = num_targets or K - 1."""
    m = targets_per_image(num_classes, num_targets)
    offsets = torch.arange(1, m + 1, device=labels.device)
    return (labels[:, None] + offsets[None, :]) % num_classes


def stats_classes(template: Optional[str], num_classes: int) -> List[int]:
    """The classes whose statistics file `template.format(label=c)` exists."""
    if not template:
        return []
    return [c for c in range(num_classes) if os.path.isfile(template.format(label=c))]


def _row_shapes(sources: FixedImageSet, m: int, feature_dims: Optional[int]) -> Dict[str, tuple]:
    """(dtype, *shape of one source's rows) of each gathered field."""
    shapes = {"pixels": (torch.uint8, m, 3, sources.size, sources.size),
              "confidence": (torch.float64, m), "success": (torch.float64, m)}
    if feature_dims is not None:
        shapes["features"] = (torch.float64, m, feature_dims)
    return shapes


@dataclass
class _Chunk:
    positions: Tensor  # (b,) source positions
    pixels: Tensor  # (b, m, 3, S, S) uint8 counterfactuals
    confidence: Tensor  # (b, m) float64
    success: Tensor  # (b, m) float64 (0/1)
    features: Optional[Tensor]  # (b, m, D) float64, or None without FID


def _attack_chunk(model: nn.Module, x: Tensor, targets: Tensor,
                  settings: CounterfactualSettings, features) -> tuple:
    b, m = targets.shape
    flat = pgd_attack(model, x.repeat_interleave(m, dim=0), steps=settings.steps,
                      step_size=settings.step_size, eps=settings.eps, norm=settings.norm,
                      objective="logit", y=targets.flatten())
    with torch.no_grad():
        logits = model(flat).double()
        confidence = logits.softmax(dim=1).gather(1, targets.flatten()[:, None])[:, 0]
        success = (logits.argmax(dim=1) == targets.flatten()).double()
        feats = None if features is None else features(to_8bit(flat)).double()
    pixels = to_8bit(flat).mul(255).round().to(torch.uint8)
    shape = (b, m)
    return (pixels.view(*shape, *flat.shape[1:]), confidence.view(shape), success.view(shape),
            None if feats is None else feats.view(*shape, -1))


def evaluate_counterfactuals(model: nn.Module, sources: FixedImageSet,
                             settings: CounterfactualSettings, runtime: Runtime, *,
                             num_classes: int, batch_size: int, folder: Optional[str] = None
                             ) -> Dict[str, Any]:
    """{"counterfactual_confidence", "counterfactual_success", "n_counterfactuals", and with
    per-class statistics "counterfactual_fid" (mean over the classes that have them)} of the
    first settings.num_images images of `sources`; files into `folder` (see the module
    docstring). `batch_size`: images per attack batch. Every rank must call this."""
    model = unwrap(model)
    n = min(settings.num_images, len(sources))
    fid_classes = decide_on_main(runtime, lambda: stats_classes(settings.fid_stats, num_classes),
                                 "look for the per-class FID statistics")
    features, dims = None, None
    if fid_classes:
        features = feature_extractor(runtime.device, settings.inception_weights)
        dims = load_reference(settings.fid_stats.format(label=fid_classes[0]))[0].shape[0]
    m = targets_per_image(num_classes, settings.num_targets)
    per_chunk = max(1, batch_size // m)  # sources per chunk: about batch_size attacks
    loader = chunk_loader(sources.images, n, per_chunk, runtime)
    chunks: List[_Chunk] = []
    with eval_mode(model):
        for images, positions in progress(loader, runtime, "counterfactuals", total=len(loader)):
            labels = sources.labels(positions.numpy()).to(runtime.device)
            targets = target_classes(labels, num_classes, settings.num_targets)
            parts = _attack_chunk(model, images.to(runtime.device), targets, settings, features)
            chunks.append(_Chunk(positions.to(runtime.device), *parts))
    gathered = {name: _gather(runtime, chunks, name, n, shape)
                for name, shape in _row_shapes(sources, m, dims).items()}
    labels = sources.labels(np.arange(n))
    targets = target_classes(labels, num_classes, settings.num_targets)
    per_class = _per_class(gathered, targets, num_classes)
    if fid_classes:
        per_class["fid"] = decide_on_main(
            runtime, lambda: _class_fids(gathered["features"], targets, fid_classes, settings),
            "compute the per-class FID of the counterfactuals")
    if folder is not None:
        on_main(runtime, lambda: _write(folder, sources, gathered["pixels"], labels, targets,
                                        per_class, num_classes),
                f"write the counterfactuals into {folder}")
    result = {"counterfactual_confidence": float(gathered["confidence"].mean()),
              "counterfactual_success": float(gathered["success"].mean()),
              "n_counterfactuals": int(targets.numel())}
    if per_class.get("fid"):
        result["counterfactual_fid"] = float(np.mean(list(per_class["fid"].values())))
    return result


def _gather(runtime: Runtime, chunks: List[_Chunk], name: str, n: int, shape: tuple
            ) -> Tensor:
    """One field of every rank's chunks, by source position, on every rank (cpu). `shape`:
    (dtype, *row shape), for a rank without chunks."""
    empty = torch.zeros((0, *shape[1:]), dtype=shape[0], device=runtime.device)
    positions = [c.positions for c in chunks] or [empty.new_zeros(0, dtype=torch.int64)]
    values = [getattr(c, name) for c in chunks] or [empty]
    return gather_by_position(runtime, torch.cat(values), torch.cat(positions), n).cpu()


def _per_class(gathered: Dict[str, Tensor], targets: Tensor, num_classes: int
               ) -> Dict[str, Dict[int, float]]:
    """Mean confidence and success per target class."""
    out: Dict[str, Dict[int, float]] = {"confidence": {}, "success": {}}
    for c in range(num_classes):
        hit = targets == c
        if hit.any():
            out["confidence"][c] = float(gathered["confidence"][hit].mean())
            out["success"][c] = float(gathered["success"][hit].mean())
    return out


def _class_fids(features: Tensor, targets: Tensor, classes: List[int],
                settings: CounterfactualSettings) -> Dict[int, float]:
    """FID of the counterfactuals toward each class against that class's statistics."""
    fids = {}
    for c in classes:
        rows = features[targets == c].double().numpy()
        if len(rows) < 2:
            continue
        path = settings.fid_stats.format(label=c)
        mu, sigma = feature_statistics(rows)
        try:
            fids[c] = frechet_distance(mu, sigma, *load_reference(path, rows.shape[1]))
        except (FIDError, ValueError) as err:
            LOGGER.warning("counterfactual FID of class %d skipped: %s", c, err)
    return fids


def _grid_tiles(source: Tensor, pixels: Tensor, label: int, targets: Tensor,
                num_classes: int) -> Tensor:
    """One grid row: a tile per class (the source in its own class) or, with fewer targets,
    the source followed by its counterfactuals."""
    if targets.numel() == num_classes - 1:
        tiles = torch.empty((num_classes, *pixels.shape[1:]), dtype=torch.float32)
        tiles[targets] = pixels.float() / 255
        tiles[label] = source
        return tiles
    return torch.cat([source[None], pixels.float() / 255])


def _write(folder: str, sources: FixedImageSet, pixels: Tensor, labels: Tensor,
           targets: Tensor, per_class: Dict[str, Any], num_classes: int) -> None:
    from torchvision.utils import save_image

    os.makedirs(folder, exist_ok=True)
    for p in range(pixels.shape[0]):
        source = sources.images(np.array([p]))[0].float()
        tiles = _grid_tiles(source, pixels[p], int(labels[p]), targets[p], num_classes)
        save_image(tiles, os.path.join(folder, f"{p}.png"), nrow=len(tiles), padding=1)
    with open(os.path.join(folder, "per_class.json"), "w") as fh:
        json.dump({k: {str(c): v for c, v in d.items()} for k, d in per_class.items()}, fh,
                  indent=2)
    LOGGER.info("counterfactual grids of %d images written to %s", pixels.shape[0], folder)


def counterfactual_settings(cfg) -> CounterfactualSettings:
    """The `eval.counterfactual_*` fields; unset attack fields take `image_log`'s."""
    ev, log = cfg.eval, cfg.image_log
    return CounterfactualSettings(
        num_images=ev.counterfactual_num_images, num_targets=ev.counterfactual_num_targets,
        steps=log.num_steps if ev.counterfactual_steps is None else ev.counterfactual_steps,
        step_size=(log.step_size if ev.counterfactual_step_size is None
                   else ev.counterfactual_step_size),
        eps=log.eps if ev.counterfactual_eps is None else ev.counterfactual_eps, norm=log.norm,
        fid_stats=ev.counterfactual_fid_stats, inception_weights=log.inception_weights)


class Counterfactuals(Metric):
    """Counterfactual explanations of the first `eval.counterfactual_num_images` test images
    (the module docstring); grids into <run_dir>/counterfactuals/ when the spec has a run_dir."""

    name = "counterfactuals"
    source = TEST_SET

    @classmethod
    def settings(cls, cfg) -> Dict[str, Any]:
        cf = counterfactual_settings(cfg)
        found = {"num_images": cf.num_images, "num_targets": cf.num_targets or "all others",
                 "steps": cf.steps, "step_size": cf.step_size, "eps": cf.eps, "norm": cf.norm,
                 "objective": "target logit", **test_set_settings(cfg)}
        if cf.fid_stats:
            found.update(fid_stats=cf.fid_stats, features=feature_network_name(),
                         inception_weights=cf.inception_weights)
        return found

    @classmethod
    def problems(cls, cfg) -> List[str]:
        template = cfg.eval.counterfactual_fid_stats
        if not template:
            return []
        found = feature_problems(cfg.image_log.inception_weights)
        if not stats_classes(template, cfg.data.num_classes):
            found.append(f"eval.counterfactual_fid_stats '{template}': no class has a "
                         "statistics file; make them with python -m rebm.eval.counterfactuals "
                         f"CONFIG --class-stats '{template}'")
        return found

    def finish(self) -> Dict[str, Any]:
        ctx = self.ctx
        folder = (os.path.join(ctx.spec.run_dir, "counterfactuals") if ctx.spec.run_dir
                  else None)
        sources = indist_test_set(ctx.cfg, test_indices(ctx.cfg))
        results = evaluate_counterfactuals(ctx.model, sources, counterfactual_settings(ctx.cfg),
                                           ctx.runtime, num_classes=ctx.cfg.data.num_classes,
                                           batch_size=ctx.batch_size, folder=folder)
        if "counterfactual_fid" in results:
            results[standin_key("counterfactual_fid")] = results.pop("counterfactual_fid")
        return results

    @classmethod
    def describe(cls, results: Dict[str, Any], settings: Dict[str, Any]
                 ) -> List[Tuple[str, str, str]]:
        how = (f"{results['n_counterfactuals']} counterfactuals of {settings['num_images']} "
               f"test images, {settings['steps']} PGD steps ({settings['norm']}, step "
               f"{settings['step_size']:g}, eps {settings['eps']:g})")
        rows = [("counterfactual confidence", f"{results['counterfactual_confidence']:.4f}", how),
                ("counterfactual success", f"{results['counterfactual_success']:.4f}", how)]
        for key in ("counterfactual_fid", "counterfactual_fid_standin"):
            if key in results:
                rows.append((key.replace("_", " "), f"{results[key]:.2f}",
                             f"per-class FID vs {settings['fid_stats']}, mean over classes"))
        return rows


# --------------------------------------------------------------------------------------------
# Per-class reference statistics: python -m rebm.eval.counterfactuals CONFIG --class-stats T
# --------------------------------------------------------------------------------------------
def class_image_set(cfg, label: int, split: str = "train") -> FixedImageSet:
    """The in-distribution images of class `label` in `split`, un-augmented, in dataset order."""
    from rebm.data.augmentations import build_augmentation
    from rebm.data.pipeline import indist_source

    source = indist_source(cfg, split)
    indices = np.flatnonzero(source.labels(np.arange(len(source))).numpy() == label)
    transform = build_augmentation("test", cfg.data.image_size, source.full_images)
    return FixedImageSet(f"{source.name} class {label}", source, transform, indices,
                         cfg.data.image_size)


def class_statistics(images: FixedImageSet, runtime: Runtime, features, batch_size: int
                     ) -> tuple:
    """(mu, sigma) of the features of every image of the set, the same on every rank (the rows
    are gathered by position and reduced in one fixed order). Every rank must call this."""
    rows = []
    positions = []
    loader = chunk_loader(images.images, len(images), batch_size, runtime)
    with torch.no_grad():
        for x, pos in progress(loader, runtime, images.name, total=len(loader)):
            rows.append(features(to_8bit(x.to(runtime.device))).double())
            positions.append(pos.to(runtime.device))
    dims = rows[0].shape[1] if rows else None
    dims = decide_on_main(runtime, lambda: dims, "share the feature size")
    empty = torch.zeros(0, dims, dtype=torch.float64, device=runtime.device)
    everything = gather_by_position(runtime, torch.cat(rows or [empty]),
                                    torch.cat(positions or [empty.new_zeros(0).long()]),
                                    len(images))
    return feature_statistics(everything.cpu().numpy())


def run_class_stats(cfg, runtime: Runtime, args) -> Dict[str, Any]:
    from rebm.distributed import setup_logging
    from rebm.eval.fid_stats import save_statistics

    setup_logging(runtime)
    if "{label}" not in args.class_stats:
        raise FIDError(f"--class-stats '{args.class_stats}' must contain {{label}} (one file "
                       "per class), e.g. data/fid_stats/cifar10_class{label}.npz")
    features = feature_extractor(runtime.device, cfg.image_log.inception_weights)
    written = {}
    for label in range(cfg.data.num_classes):
        images = class_image_set(cfg, label, args.split)
        if len(images) < 2:
            raise FIDError(f"class {label} has {len(images)} {args.split} images; FID "
                           "statistics need at least 2")
        mu, sigma = class_statistics(images, runtime, features, args.batch_size)
        path = args.class_stats.format(label=label)
        on_main(runtime, lambda p=path, m=mu, s=sigma: save_statistics(p, m, s), f"write {path}")
        written[label] = (path, len(images))
        LOGGER.info("class %d: statistics of %d images written to %s", label, len(images), path)
    return written


def main(argv: Optional[List[str]] = None) -> int:
    from rebm import cli

    parser = cli.build_parser("rebm.eval.counterfactuals",
                              "Per-class FID statistics for the counterfactual FID")
    parser.add_argument("--class-stats", required=True, metavar="TEMPLATE",
                        help="the .npz files to write, a path with {label}")
    parser.add_argument("--split", choices=("train", "test"), default="train")
    parser.add_argument("--batch-size", type=int, default=100, help="images per batch")
    return cli.run_entry(parser, argv, run_class_stats)


if __name__ == "__main__":
    import sys

    sys.exit(main())
