"""Counterfactual explanations: how an image must change for the model to see another class.

Protocols (`eval.counterfactual_protocol`), both by targeted PGD ascent on the target logit with
the generation threat model by default (`image_log`), counterfactuals rounded to 8 bits as the
original's `save_image` wrote them:
- `original` (default; the original's `generate_counterfactuals`, rebm/eval/eval_utils.py
  there): every training image (or the first `num_images`) toward ONE random other class drawn
  from (rand_seed, dataset index) (`random_targets`); FID per target class against that class's
  statistics, the per-class mean confidence averaged over the classes. Work goes class by class
  (`class_chunks`) keeping only running feature sums: memory does not grow with the images.
- `grid`: each of the first `num_images` test images (default 10) toward every other class (or
  `num_targets` of them: y+1, y+2, ... mod K).
Per-class statistics (`fid_stats`, a path with `{label}`): `python -m rebm.eval.counterfactuals
CONFIG --class-stats TEMPLATE`, by default of the training split like the original's reference
folders (./datasets/cifar10_images_by_classes/train/<c>). Classes without a file have no FID.

Files (rank 0, with a folder): original: `counterfactuals.png` / `sources.png` (the first 10
counterfactuals toward each of the first 10 classes, a row per class, and their sources) and
`per_class.json`; grid: `<position>.png` (one grid per image) and `per_class.json`.

Sources go in fixed chunks, chunk k on rank k % W, per-image results gathered by position: the
same numbers on any number of processes (the FID up to the order of its float64 sums).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from rebm.attacks.pgd import pgd_attack
from rebm.data.ood_sets import FixedImageSet, indist_test_set
from rebm.data.sampling import sample_keys
from rebm.distributed import Runtime
from rebm.distributed.collectives import decide_on_main, on_main
from rebm.distributed.logs import progress
from rebm.distributed.parallel import unwrap
from rebm.eval.accuracy import eval_mode
from rebm.eval.fid import (
    FEATURES_ENV,
    FIDError,
    MomentSums,
    feature_extractor,
    feature_network_name,
    feature_problems,
    feature_statistics,
    frechet_distance,
    hub_weights_path,
    load_reference,
    moments_statistics,
    standin_key,
    to_8bit,
)
from rebm.eval.metric import TEST_SET, EvalError, Metric, to_pixels
from rebm.eval.ood import chunk_loader, gather_by_position
from rebm.eval.test_set import test_indices, test_set_files, test_set_settings

LOGGER = logging.getLogger("rebm")
# 8-bit counterfactuals as the original wrote them: torchvision's save_image rounds
# (eval_utils.py's generate_counterfactuals, vutils.save_image)
COUNTERFACTUAL_PIXELS = "round"
GRID_NUM_IMAGES = 10  # grid: test images explained when eval.counterfactual_num_images is null


@dataclass(frozen=True)
class CounterfactualSettings:
    """What the counterfactuals compute (the `eval.counterfactual_*` fields)."""

    protocol: str = "grid"
    num_images: Optional[int] = GRID_NUM_IMAGES  # original: None = every training image
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
    gathered = {name: _gather(runtime, [(c.positions, getattr(c, name)) for c in chunks], n,
                              shape)
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


def _gather(runtime: Runtime, parts: List[Tuple[Tensor, Tensor]], n: int, shape: tuple
            ) -> Tensor:
    """Every rank's (positions, rows) parts, rows put at their positions of [0, n), on every
    rank (cpu). `shape`: (dtype, *row shape), for a rank without parts."""
    empty = torch.zeros((0, *shape[1:]), dtype=shape[0], device=runtime.device)
    positions = torch.cat([p for p, _ in parts] or [empty.new_zeros(0, dtype=torch.int64)])
    rows = torch.cat([r for _, r in parts] or [empty])
    return gather_by_position(runtime, rows, positions, n).cpu()


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


# --------------------------------------------------------------------------------------------
# The original protocol: training images, one seeded random target class each, FID per class
# --------------------------------------------------------------------------------------------
TARGET_STREAM = "counterfactual"  # key stream of the random target classes
PREVIEW = 10  # the preview grid: PREVIEW counterfactuals toward each of the first PREVIEW classes


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
    """Item j = (images, positions, class) of this rank's j-th chunk."""

    def __init__(self, sources: FixedImageSet, chunks: List[Tuple[int, np.ndarray]]):
        self.sources, self.chunks = sources, chunks

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, j: int):
        c, positions = self.chunks[j]
        return self.sources.images(positions), torch.from_numpy(positions), c


def _preview_slots(targets: np.ndarray, num_classes: int) -> Dict[int, int]:
    """{position: grid slot} of the first PREVIEW counterfactuals toward each of the first
    PREVIEW classes (slot = PREVIEW * class + rank within the class: a row per class)."""
    slots = {}
    for c in range(min(PREVIEW, num_classes)):
        for k, p in enumerate(np.flatnonzero(targets == c)[:PREVIEW]):
            slots[int(p)] = PREVIEW * c + k
    return slots


class _OriginalRun:
    """One rank's state of `evaluate_original_counterfactuals`: per-image results, preview
    pixels, the running feature sums of the class in progress, the per-class FIDs."""

    def __init__(self, settings: CounterfactualSettings, runtime: Runtime, targets: np.ndarray,
                 num_classes: int, fid_classes: List[int]):
        self.settings, self.runtime, self.num_classes = settings, runtime, num_classes
        self.counts = np.bincount(targets, minlength=num_classes)
        self.fid_classes = set(fid_classes)
        self.features = (feature_extractor(runtime.device, settings.inception_weights)
                         if fid_classes else None)
        self.slots = _preview_slots(targets, num_classes)
        self.scores: List[Tuple[Tensor, Tensor]] = []  # (positions, (b, 2) confidence, success)
        self.preview: List[Tuple[Tensor, Tensor]] = []  # (slots, uint8 pixels)
        self.sums = MomentSums()  # of the class in progress
        self.fids: Dict[int, float] = {}

    def attack(self, model: nn.Module, images: Tensor, positions: Tensor, c: int) -> None:
        rt, st = self.runtime, self.settings
        x = images.to(rt.device)
        y = torch.full((x.shape[0],), c, dtype=torch.int64, device=rt.device)
        adv = pgd_attack(model, x, steps=st.steps, step_size=st.step_size, eps=st.eps,
                         norm=st.norm, objective="logit", y=y)
        pixels = to_pixels(adv, COUNTERFACTUAL_PIXELS)
        with torch.no_grad():
            logits = model(adv).double()
            confidence = logits.softmax(dim=1)[:, c]
            success = (logits.argmax(dim=1) == c).double()
            if c in self.fid_classes:
                self.sums.add(self.features(pixels.float().div(255)))
        self.scores.append((positions.to(rt.device), torch.stack([confidence, success], 1)))
        shown = [k for k, p in enumerate(positions.tolist()) if p in self.slots]
        if shown:
            slots = [self.slots[int(positions[k])] for k in shown]
            self.preview.append((torch.tensor(slots, device=rt.device), pixels[shown]))

    def finish_class(self, c: int) -> None:
        """Class c's FID from every rank's sums. Every rank calls this for every class, in
        order, after its chunks of the class, so the collectives line up."""
        sums, self.sums = self.sums, MomentSums()
        if c not in self.fid_classes or self.counts[c] < 2:
            return
        mu, sigma = sums.statistics(self.runtime)
        template = self.settings.fid_stats
        fid = decide_on_main(self.runtime, lambda: _class_fid(c, mu, sigma, template),
                             f"compute the counterfactual FID of class {c}")
        if fid is not None:
            self.fids[c] = fid


def _class_fid(c: int, mu: np.ndarray, sigma: np.ndarray, template: str) -> Optional[float]:
    try:
        return frechet_distance(mu, sigma, *load_reference(template.format(label=c),
                                                           mu.shape[0]))
    except (FIDError, ValueError) as err:
        LOGGER.warning("counterfactual FID of class %d skipped: %s", c, err)
        return None


def evaluate_original_counterfactuals(model: nn.Module, sources: FixedImageSet,
                                      targets: Tensor, settings: CounterfactualSettings,
                                      runtime: Runtime, *, num_classes: int, batch_size: int,
                                      folder: Optional[str] = None, num_workers: int = 0
                                      ) -> Dict[str, Any]:
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
            for images, positions, _ in progress(itertools.islice(items, count), runtime,
                                                 f"counterfactuals toward class {c}", count):
                run.attack(model, images, positions, c)
            run.finish_class(c)
    scores = _gather(runtime, run.scores, n, (torch.float64, 2))
    per_class: Dict[str, Dict[int, float]] = {"confidence": {}, "success": {}, "count": {}}
    for c in np.flatnonzero(run.counts):
        hit = torch.from_numpy(wanted == c)
        per_class["confidence"][int(c)] = float(scores[hit, 0].mean())
        per_class["success"][int(c)] = float(scores[hit, 1].mean())
        per_class["count"][int(c)] = int(run.counts[c])
    per_class["fid"] = dict(run.fids)
    if folder is not None:
        pixels = _gather(runtime, run.preview, PREVIEW * min(PREVIEW, num_classes),
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
    from torchvision.utils import save_image

    os.makedirs(folder, exist_ok=True)
    if slots:  # a row per class; a class with fewer than PREVIEW counterfactuals ends in black
        originals = torch.zeros(pixels.shape, dtype=torch.float32)
        positions = np.array(sorted(slots))
        originals[[slots[p] for p in positions]] = sources.images(positions).float()
        save_image(pixels.float() / 255, os.path.join(folder, "counterfactuals.png"),
                   nrow=PREVIEW, padding=1)
        save_image(originals, os.path.join(folder, "sources.png"), nrow=PREVIEW, padding=1)
    with open(os.path.join(folder, "per_class.json"), "w") as fh:
        json.dump({k: {str(c): v for c, v in d.items()} for k, d in per_class.items()}, fh,
                  indent=2)
    LOGGER.info("counterfactual previews and per-class results written to %s", folder)


def train_image_set(cfg, num_images: Optional[int]) -> FixedImageSet:
    """The first `num_images` (None: all) training images, un-augmented, in dataset order."""
    from rebm.data.augmentations import build_augmentation
    from rebm.data.pipeline import indist_source

    source = indist_source(cfg, "train")
    n = len(source) if num_images is None else min(num_images, len(source))
    transform = build_augmentation("test", cfg.data.image_size, source.full_images)
    return FixedImageSet(f"{source.name} (train)", source, transform, np.arange(n),
                         cfg.data.image_size)


def counterfactual_settings(cfg) -> CounterfactualSettings:
    """The `eval.counterfactual_*` fields; unset attack fields take `image_log`'s."""
    ev, log = cfg.eval, cfg.image_log
    num_images = ev.counterfactual_num_images
    if num_images is None and ev.counterfactual_protocol == "grid":
        num_images = GRID_NUM_IMAGES
    return CounterfactualSettings(
        protocol=ev.counterfactual_protocol, num_images=num_images,
        num_targets=ev.counterfactual_num_targets,
        steps=log.num_steps if ev.counterfactual_steps is None else ev.counterfactual_steps,
        step_size=(log.step_size if ev.counterfactual_step_size is None
                   else ev.counterfactual_step_size),
        eps=log.eps if ev.counterfactual_eps is None else ev.counterfactual_eps, norm=log.norm,
        fid_stats=ev.counterfactual_fid_stats, inception_weights=log.inception_weights)


class Counterfactuals(Metric):
    """Counterfactual explanations, by `eval.counterfactual_protocol` (the module docstring);
    previews or grids into <run_dir>/counterfactuals/ when the spec has a run_dir."""

    name = "counterfactuals"
    source = TEST_SET
    # 2: the original protocol (training images, one seeded random target each, per-class FID)
    # is the default; settings name the protocol
    protocol = 2

    @classmethod
    def settings(cls, cfg) -> Dict[str, Any]:
        cf = counterfactual_settings(cfg)
        found: Dict[str, Any] = {
            "protocol": cf.protocol, "steps": cf.steps, "step_size": cf.step_size,
            "eps": cf.eps, "norm": cf.norm, "objective": "target logit",
            "pixels": COUNTERFACTUAL_PIXELS}
        if cf.protocol == "original":
            found.update(dataset=cfg.data.indist_dataset, split="train",
                         num_images=cf.num_images or "all", image_size=cfg.data.image_size,
                         targets="one random other class per image", target_seed=cfg.rand_seed)
        else:
            found.update(test_set_settings(cfg))  # its num_images: of the test set
            found.update(test_num_images=found["num_images"], num_images=cf.num_images,
                         num_targets=cf.num_targets or "all others")
        if cf.fid_stats:
            found.update(fid_stats=cf.fid_stats, features=feature_network_name(),
                         inception_weights=cf.inception_weights)
        return found

    @classmethod
    def files(cls, cfg) -> Dict[str, Optional[str]]:
        """The dataset root (and ids file), each class's statistics file and, for Inception
        features, their weights."""
        ev = cfg.eval
        found: Dict[str, Optional[str]] = (
            {"data.indist_ds_dir": cfg.data.indist_ds_dir}
            if ev.counterfactual_protocol == "original" else test_set_files(cfg))
        template = ev.counterfactual_fid_stats
        if template:
            for c in range(cfg.data.num_classes):
                found[f"eval.counterfactual_fid_stats[{c}]"] = template.format(label=c)
            if not os.environ.get(FEATURES_ENV):
                found["image_log.inception_weights"] = (cfg.image_log.inception_weights
                                                        or hub_weights_path())
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
        ctx, cfg = self.ctx, self.ctx.cfg
        folder = (os.path.join(ctx.spec.run_dir, "counterfactuals") if ctx.spec.run_dir
                  else None)
        settings = counterfactual_settings(cfg)
        if settings.protocol == "original":
            from rebm.data.pipeline import loader_workers

            sources = train_image_set(cfg, settings.num_images)
            targets = random_targets(sources.labels(np.arange(len(sources))), sources.indices,
                                     cfg.data.num_classes, cfg.rand_seed)
            results = evaluate_original_counterfactuals(
                ctx.model, sources, targets, settings, ctx.runtime,
                num_classes=cfg.data.num_classes, batch_size=ctx.batch_size, folder=folder,
                num_workers=loader_workers(cfg, ctx.runtime))
        else:
            sources = indist_test_set(cfg, test_indices(cfg))
            results = evaluate_counterfactuals(ctx.model, sources, settings, ctx.runtime,
                                               num_classes=cfg.data.num_classes,
                                               batch_size=ctx.batch_size, folder=folder)
        return {(standin_key("counterfactual_fid") + key[len("counterfactual_fid"):]
                 if key.startswith("counterfactual_fid") else key): value
                for key, value in results.items()}

    @classmethod
    def describe(cls, results: Dict[str, Any], settings: Dict[str, Any]
                 ) -> List[Tuple[str, str, str]]:
        images = ("training images, one random target each"
                  if settings.get("protocol") == "original" else "test images")
        how = (f"{results['n_counterfactuals']} counterfactuals of {settings['num_images']} "
               f"{images}, {settings['steps']} PGD steps ({settings['norm']}, step "
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
    """(mu, sigma) of the features of every image of the set (8-bit images read as pytorch-fid
    reads their files, k / 255), from running sums over all ranks. Every rank must call this."""
    loader = chunk_loader(images.images, len(images), batch_size, runtime)
    with torch.no_grad():
        return moments_statistics(
            (features(to_8bit(x.to(runtime.device), COUNTERFACTUAL_PIXELS))
             for x, _ in progress(loader, runtime, images.name, total=len(loader))), runtime)


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
