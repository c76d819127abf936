"""The `original` counterfactual protocol (the original's `generate_counterfactuals`,
rebm/eval/eval_utils.py there): every training image (or the first `num_images`) toward ONE
random other class drawn from (rand_seed, dataset index) (`random_targets`); FID per target
class against that class's statistics, the per-class mean confidence and success averaged over
the classes. Work goes class by class (`class_chunks`) keeping only running feature sums:
memory does not grow with the images. Files: `counterfactuals.png` / `sources.png` (the first
PREVIEW counterfactuals toward each of the first PREVIEW classes, a row per class, and their
sources) and `per_class.json`.

Chunk g of `class_chunks` goes to rank g % W, per-image results gathered by position: the same
numbers on any number of processes (the FID up to the order of its float64 sums).
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from torchvision.utils import save_image

from rebm.config.views import EvaluationSection
from rebm.data.augmentations import build_augmentation
from rebm.data.indexing import sample_keys
from rebm.data.ood_datasets import FixedImageSet
from rebm.data.pipeline import indist_source
from rebm.distributed import Runtime
from rebm.distributed.collectives import decide_on_main, on_main
from rebm.distributed.logs import progress
from rebm.distributed.parallel import unwrap
from rebm.distributed.signals import stop_points_all_ranks
from rebm.eval.features.fid import MomentSums, feature_extractor
from rebm.eval.features.network import feature_network
from rebm.eval.metric import EvalError
from rebm.eval.metrics.counterfactuals.attack import (
    CounterfactualSettings,
    attack_toward,
    class_fid,
    gather_parts_all_ranks,
    stats_classes,
    write_per_class,
)
from rebm.eval.passes import eval_mode

LOGGER = logging.getLogger("rebm")
TARGET_STREAM = "counterfactual"  # key stream of the random target classes
PREVIEW = 10  # the preview grid: PREVIEW counterfactuals toward each of the first PREVIEW classes


def train_image_set(evaluation: EvaluationSection, num_images: Optional[int]) -> FixedImageSet:
    """The first `num_images` (None: all) training images, un-augmented, in dataset order."""
    source = indist_source(evaluation.data, "train")
    n = len(source) if num_images is None else min(num_images, len(source))
    transform = build_augmentation("test", evaluation.data.image_size, source.full_images)
    return FixedImageSet(f"{source.name} (train)", source, transform, np.arange(n),
                         evaluation.data.image_size)


def random_targets(labels: Tensor, indices: np.ndarray, num_classes: int, seed: int) -> Tensor:
    """One target class per image, never its own: (y + 1 + r) mod K, r uniform in [0, K - 2]
    from (seed, dataset index) alone, so the same on any world size and batch size. (The
    original drew r per batch with torch.randint(1, K) on the device's generator, which its
    counterfactual entry point never seeds.)"""
    if num_classes < 2:
        raise EvalError("counterfactuals need at least 2 classes (data.num_classes)")
    keys = sample_keys(seed, TARGET_STREAM, 0, indices)
    shift = torch.from_numpy(keys % (num_classes - 1)).to(labels.dtype)
    return (labels + 1 + shift) % num_classes


def class_chunks(targets: np.ndarray, num_classes: int, batch_size: int
                 ) -> List[Tuple[int, np.ndarray]]:
    """(class c, positions) of every chunk: the positions targeted at c in order, cut into
    chunks of `batch_size`, class after class. Chunk g goes to rank g % W."""
    chunks = []
    for c in range(num_classes):
        where = np.flatnonzero(targets == c)
        chunks += [(c, where[s:s + batch_size]) for s in range(0, len(where), batch_size)]
    return chunks


class _ClassChunks(Dataset):
    """Item j = (images, positions) of this rank's j-th chunk (its class: the loop's)."""

    def __init__(self, sources: FixedImageSet, chunks: List[Tuple[int, np.ndarray]]):
        self.sources, self.chunks = sources, chunks

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, j: int) -> Tuple[Tensor, Tensor]:
        positions = self.chunks[j][1]
        return self.sources.images(positions), torch.from_numpy(positions)


def _preview_slots(targets: np.ndarray, num_classes: int) -> Dict[int, int]:
    """{position: grid slot} of the first PREVIEW counterfactuals toward each of the first
    PREVIEW classes (slot = PREVIEW * class + rank within the class: a row per class)."""
    slots = {}
    for c in range(min(PREVIEW, num_classes)):
        for k, p in enumerate(np.flatnonzero(targets == c)[:PREVIEW]):
            slots[int(p)] = PREVIEW * c + k
    return slots


class _OriginalRun:
    """One rank's state of `evaluate_original_counterfactuals_all_ranks`: per-image results,
    preview pixels, the running feature sums of the class in progress, the per-class FIDs."""

    def __init__(self, settings: CounterfactualSettings, runtime: Runtime, targets: np.ndarray,
                 num_classes: int, fid_classes: List[int]):
        self.settings, self.runtime, self.num_classes = settings, runtime, num_classes
        self.counts = np.bincount(targets, minlength=num_classes)
        self.fid_classes = set(fid_classes)
        self.features = (feature_extractor(runtime.device, settings.image_log)
                         if fid_classes else None)
        self.slots = _preview_slots(targets, num_classes)
        self.scores: List[Tuple[Tensor, Tensor]] = []  # (positions, (b, 2) confidence, success)
        self.preview: List[Tuple[Tensor, Tensor]] = []  # (slots, uint8 pixels)
        self.sums = MomentSums()  # of the class in progress
        self.fids: Dict[int, float] = {}

    def attack(self, model: nn.Module, images: Tensor, positions: Tensor, c: int) -> None:
        device = self.runtime.device
        x = images.to(device)
        y = torch.full((x.shape[0],), c, dtype=torch.int64, device=device)
        pixels, confidence, success = attack_toward(model, x, y, self.settings)
        if c in self.fid_classes:
            with torch.no_grad():
                self.sums.add(self.features(pixels.float().div(255)))
        self.scores.append((positions.to(device), torch.stack([confidence, success], 1)))
        shown = [k for k, p in enumerate(positions.tolist()) if p in self.slots]
        if shown:
            slots = [self.slots[int(positions[k])] for k in shown]
            self.preview.append((torch.tensor(slots, device=device), pixels[shown]))

    def finish_class_all_ranks(self, c: int) -> None:
        """Class c's FID from every rank's sums. Every rank calls this for every class, in
        order, after its chunks of the class, so the collectives line up."""
        sums, self.sums = self.sums, MomentSums()
        if c not in self.fid_classes or self.counts[c] < 2:
            return
        mu, sigma = sums.statistics_all_ranks(self.runtime)
        template = self.settings.fid_stats
        fid = decide_on_main(self.runtime, lambda: class_fid(c, mu, sigma, template,
                                                           feature_network(self.settings.image_log)),
                             f"compute the counterfactual FID of class {c}")
        if fid is not None:
            self.fids[c] = fid


def evaluate_original_counterfactuals_all_ranks(model: nn.Module, sources: FixedImageSet,
                                                targets: Tensor,
                                                settings: CounterfactualSettings,
                                                runtime: Runtime, *, num_classes: int,
                                                batch_size: int, folder: Optional[str] = None,
                                                num_workers: int = 0) -> Dict[str, Any]:
    """Every image of `sources` toward its class of `targets` (the module docstring):
    {"counterfactual_confidence", "counterfactual_success" (means over the target classes of
    the per-class means), "n_counterfactuals", and with statistics "counterfactual_fid" (mean
    over the classes) and "counterfactual_fid/<c>"}. Every rank must call this."""
    model = unwrap(model)
    n, wanted = len(sources), targets.numpy()
    fid_classes = decide_on_main(runtime, lambda: stats_classes(settings.fid_stats, num_classes),
                                 "look for the per-class FID statistics")
    run = _OriginalRun(settings, runtime, wanted, num_classes, fid_classes)
    mine = class_chunks(wanted, num_classes, batch_size)[runtime.rank::runtime.world_size]
    per_class_chunks = np.bincount([c for c, _ in mine], minlength=num_classes)
    items = iter(DataLoader(_ClassChunks(sources, mine), batch_size=None,
                            num_workers=num_workers))
    with eval_mode(model):
        for c in range(num_classes):  # one loop per class: its collectives come after it
            count = int(per_class_chunks[c])
            stops = stop_points_all_ranks(runtime, count)
            for index, (images, positions) in enumerate(progress(
                    itertools.islice(items, count), runtime, f"counterfactuals toward class {c}",
                    count)):
                stops.check_all_ranks(index)
                run.attack(model, images, positions, c)
            run.finish_class_all_ranks(c)
    scores = gather_parts_all_ranks(runtime, run.scores, n, (torch.float64, 2))
    per_class: Dict[str, Dict[int, Any]] = {"confidence": {}, "success": {}, "count": {}}
    for c in np.flatnonzero(run.counts):
        hit = torch.from_numpy(wanted == c)
        per_class["confidence"][int(c)] = float(scores[hit, 0].mean())
        per_class["success"][int(c)] = float(scores[hit, 1].mean())
        per_class["count"][int(c)] = int(run.counts[c])
    per_class["fid"] = dict(run.fids)
    if folder is not None:
        pixels = gather_parts_all_ranks(runtime, run.preview, PREVIEW * min(PREVIEW, num_classes),
                                        (torch.uint8, 3, sources.size, sources.size))
        on_main(runtime, lambda: _write_original(folder, sources, pixels, run.slots, per_class),
                f"write the counterfactuals into {folder}")
    result = {"counterfactual_confidence": float(np.mean(list(per_class["confidence"].values()))),
              "counterfactual_success": float(np.mean(list(per_class["success"].values()))),
              "n_counterfactuals": n}
    if run.fids:
        result["counterfactual_fid"] = float(np.mean(list(run.fids.values())))
        result.update({f"counterfactual_fid/{c}": v for c, v in sorted(run.fids.items())})
    return result


def _write_original(folder: str, sources: FixedImageSet, pixels: Tensor,
                    slots: Dict[int, int], per_class: Dict[str, Any]) -> None:
    os.makedirs(folder, exist_ok=True)
    if slots:  # a row per class; a class with fewer than PREVIEW counterfactuals ends in black
        originals = torch.zeros(pixels.shape, dtype=torch.float32)
        positions = np.array(sorted(slots))
        originals[[slots[p] for p in positions]] = sources.images(positions).float()
        save_image(pixels.float() / 255, os.path.join(folder, "counterfactuals.png"),
                   nrow=PREVIEW, padding=1)
        save_image(originals, os.path.join(folder, "sources.png"), nrow=PREVIEW, padding=1)
    write_per_class(folder, per_class)
    LOGGER.info("counterfactual previews and per-class results written to %s", folder)
