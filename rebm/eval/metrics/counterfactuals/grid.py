"""The `grid` counterfactual protocol: each of the first `num_images` test images (default
GRID_NUM_IMAGES) toward every other class (or `num_targets` of them: y+1, y+2, ... mod K); the
mean target confidence and success over all counterfactuals, with per-class statistics the FID
of the counterfactuals toward each class. Files: `<position>.png` (one grid per image) and
`per_class.json`.

Sources go in fixed chunks, chunk k on rank k % W, per-image rows gathered by position: the same
numbers on any number of processes.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torch import Tensor, nn
from torchvision.utils import save_image

from rebm.data.ood_datasets import FixedImageSet
from rebm.distributed import Runtime
from rebm.distributed.collectives import decide_on_main, on_main
from rebm.distributed.logs import progress
from rebm.distributed.parallel import unwrap
from rebm.distributed.signals import stop_points_all_ranks
from rebm.eval.features.fid import feature_extractor, feature_statistics, load_reference
from rebm.eval.features.network import feature_network
from rebm.eval.files import write_replacing
from rebm.eval.metrics.counterfactuals.attack import (
    CounterfactualSettings,
    attack_toward,
    class_fid,
    gather_parts_all_ranks,
    stats_classes,
    write_per_class,
)
from rebm.eval.passes import chunk_loader, eval_mode

LOGGER = logging.getLogger("rebm")
GRID_NUM_IMAGES = 10  # test images explained when eval.counterfactual_num_images is null


def grid_num_images(num_images: Optional[int]) -> int:
    return GRID_NUM_IMAGES if num_images is None else num_images


def targets_per_image(num_classes: int, num_targets: Optional[int] = None) -> int:
    return num_classes - 1 if num_targets is None else min(num_targets, num_classes - 1)


def target_classes(labels: Tensor, num_classes: int, num_targets: Optional[int] = None
                   ) -> Tensor:
    """(B, m) targets of B images: y+1, ..., y+m (mod K), m = num_targets or K - 1."""
    m = targets_per_image(num_classes, num_targets)
    offsets = torch.arange(1, m + 1, device=labels.device)
    return (labels[:, None] + offsets[None, :]) % num_classes


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
    """(pixels, confidence, success, features) of the (b, m) counterfactuals of b images."""
    b, m = targets.shape
    pixels, confidence, success = attack_toward(model, x.repeat_interleave(m, dim=0),
                                                targets.flatten(), settings)
    with torch.no_grad():
        feats = None if features is None else features(pixels.float().div(255)).double()
    shape = (b, m)
    return (pixels.view(*shape, *pixels.shape[1:]), confidence.view(shape), success.view(shape),
            None if feats is None else feats.view(*shape, -1))


def evaluate_grid_counterfactuals_all_ranks(model: nn.Module, sources: FixedImageSet,
                                            settings: CounterfactualSettings, runtime: Runtime, *,
                                            num_classes: int, batch_size: int,
                                            folder: Optional[str] = None) -> Dict[str, Any]:
    """{"counterfactual_confidence", "counterfactual_success", "n_counterfactuals", and with
    per-class statistics "counterfactual_fid" (mean over the classes that have them)} of the
    first settings.num_images (None: GRID_NUM_IMAGES) images of `sources`; files into
    `folder` (see the module docstring). `batch_size`: images per attack batch. Every rank
    must call this."""
    model = unwrap(model)
    n = min(grid_num_images(settings.num_images), len(sources))
    fid_classes = decide_on_main(runtime, lambda: stats_classes(settings.fid_stats, num_classes),
                                 "look for the per-class FID statistics")
    features, dims = None, None
    if fid_classes:
        features = feature_extractor(runtime.device, settings.image_log)
        dims = load_reference(settings.fid_stats.format(label=fid_classes[0]),
                              key="eval.counterfactual_fid_stats")[0].shape[0]
    m = targets_per_image(num_classes, settings.num_targets)
    per_chunk = max(1, batch_size // m)  # sources per chunk: about batch_size attacks
    loader = chunk_loader(sources.images, n, per_chunk, runtime)
    chunks: List[_Chunk] = []
    with eval_mode(model):
        stops = stop_points_all_ranks(runtime, len(loader))
        for index, (images, positions) in enumerate(progress(loader, runtime, "counterfactuals",
                                                             total=len(loader))):
            stops.check_all_ranks(index)
            labels = sources.labels(positions.numpy()).to(runtime.device)
            targets = target_classes(labels, num_classes, settings.num_targets)
            parts = _attack_chunk(model, images.to(runtime.device), targets, settings, features)
            chunks.append(_Chunk(positions.to(runtime.device), *parts))
    gathered = {name: gather_parts_all_ranks(runtime, [(c.positions, getattr(c, name))
                                                       for c in chunks], n, shape)
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
        fid = class_fid(c, *feature_statistics(rows), settings.fid_stats,
                            feature_network(settings.image_log))
        if fid is not None:
            fids[c] = fid
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
    os.makedirs(folder, exist_ok=True)
    for p in range(pixels.shape[0]):
        source = sources.images(np.array([p]))[0].float()
        tiles = _grid_tiles(source, pixels[p], int(labels[p]), targets[p], num_classes)
        write_replacing(os.path.join(folder, f"{p}.png"),
                        lambda tmp, tiles=tiles: save_image(tiles, tmp, nrow=len(tiles),
                                                            padding=1, format="png"))
    write_per_class(folder, per_class)
    LOGGER.info("counterfactual grids of %d images written to %s", pixels.shape[0], folder)
