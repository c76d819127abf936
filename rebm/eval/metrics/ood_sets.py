"""OOD detection: in-distribution test images (positives) against out-distribution images
(negatives), scored by the max-softmax probability ("msp") or by logsumexp of the logits
("lse"); AUROC and FPR at 95 % TPR, on clean and on adversarially moved OOD images.

Adversarial OOD: each OOD image is first moved by PGD to *raise* its score, as the original
evaluation did: "lse" ascends logsumexp, "msp" ascends KL(uniform || softmax), which pushes the
softmax away from uniform and so raises its maximum. L2 steps, no random start; the original's
budgets by the side of the OOD images (`original_ood_attack`). The OOD images are read at 224 px
for every ImageNet model, as the original's, and at the model's own side for every other
(`ood_image_size`): 32 px for CIFAR, as the original's. In-distribution images are not attacked. The scores are computed in float32, as the original's.

The metric "ood_sets" (`OODSets`, the paper's OOD table): the in-distribution scores from the
shared test pass, then each set of `rebm.data.ood_datasets` (`eval.ood_num_samples` images each).
OOD images go through the model in fixed chunks of the evaluation batch, chunk k on rank k % W,
and the scores are gathered by position, so every number is the same on any number of
processes (bit for bit at the same number of threads per process). The loader and the padded
gather of metric "ood" (rebm/eval/metrics/ood_detection.py) are here too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from rebm.attacks.pgd import pgd_attack
from rebm.auc import binary_auc
from rebm.config.evaluation_ood import OOD_SET_NAMES
from rebm.config.views import EvaluationSection
from rebm.data.indexing import eval_shard
from rebm.data.ood_datasets import DEFAULT_ROOTS, load_ood_set, ood_set_name
from rebm.data.pipeline import load_outdist, loader_workers
from rebm.distributed import Runtime, all_gather_cat, all_reduce_max
from rebm.distributed.collectives import all_gather_by_index
from rebm.distributed.logs import progress
from rebm.distributed.parallel import unwrap
from rebm.distributed.signals import stop_points_all_ranks
from rebm.eval.metric import TEST_SET, EvalContext, Metric, TestBatch
from rebm.eval.passes import chunk_loader, eval_mode
from rebm.eval.test_set import test_set_settings

SCORES = ("msp", "lse")
SCORE_ALIASES = {"max_softmax": "msp"}  # the older spelling
LARGE_IMAGE_SIZE = 128  # from here on ImageNet-size OOD images: the ImageNet attack budget
# The original's OOD side for ImageNet and Restricted ImageNet models whatever their own size
# (its rebm/eval/eval_ood_detection.py:53-61)
ORIGINAL_IMAGENET_OOD_SIZE = 224
IMAGENET_DATASETS = ("imagenet", "restrictedimagenet")
TPR_PERCENT = 95


@dataclass(frozen=True)
class OODAttack:
    """An L2 PGD budget: radius, number of steps, step length."""

    eps: float
    steps: int
    step_size: float


def ood_image_size(evaluation: EvaluationSection) -> int:
    """The side the OOD images are read at: eval.ood_image_size, else 224 px for ImageNet models
    (of 224 and 256 px alike, the original's, eval_ood_detection.py:53-61) and the model's own
    data.image_size for every other. The original read 32 px for every non-ImageNet model
    because all of them were 32 px (CIFAR); a 16 px digits model read at 32 px would be scored
    on images twice its side, and noise that large is trivially told apart."""
    if evaluation.eval.ood_image_size is not None:
        return evaluation.eval.ood_image_size
    if evaluation.data.indist_dataset.lower() in IMAGENET_DATASETS:
        return ORIGINAL_IMAGENET_OOD_SIZE
    return evaluation.data.image_size


def original_ood_attack(image_size: int) -> OODAttack:
    """The original's adversarial-OOD budget for OOD images of side `image_size`: L2 3.0 in 10
    steps of 1.0 for ImageNet-size images, L2 1.0 in 20 steps of 0.1 for 32 px ones. (The
    original tested `side == 224`; its OOD images were only ever 32 or 224 px, so from 128 px
    on gives the same budgets and keeps the ImageNet one for any other large side.)"""
    if image_size >= LARGE_IMAGE_SIZE:
        return OODAttack(eps=3.0, steps=10, step_size=1.0)
    return OODAttack(eps=1.0, steps=20, step_size=0.1)


def canonical_score(score: str) -> str:
    score = SCORE_ALIASES.get(score, score)
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    return score


def ood_score(logits: Tensor, score: str) -> Tensor:
    """Per-image score (higher = more in-distribution), computed in float32 as the original's
    (its rebm/eval/eval_utils.py:1165, 1207, 1269: softmax, max or logsumexp of float32 logits),
    returned as float64 (exact) for the gathers. In float64 a near-tie pair of scores can order
    the other way and move the AUROC by 1/(n_pos n_neg) (docs/performance.md)."""
    logits = logits.float()
    if canonical_score(score) == "msp":
        scores = logits.softmax(dim=1).max(dim=1).values
    else:
        scores = torch.logsumexp(logits, dim=1)
    return scores.double()


def attack_objective(score: str) -> str:
    """The PGD objective that raises `score` (see the module docstring)."""
    return "uniform_kl" if canonical_score(score) == "msp" else "lse"


def fpr_at_tpr(pos_scores: Tensor, neg_scores: Tensor, tpr_percent: int = TPR_PERCENT) -> float:
    """False-positive rate at the first ROC point (thresholds descending) whose true-positive
    rate reaches tpr_percent %: the threshold t is the k-th largest positive score,
    k = ceil(tpr_percent / 100 * n_pos), and the FPR is the fraction of negatives >= t. Exact
    with ties (an image scoring exactly t counts as positive, as in scikit-learn's roc_curve)."""
    pos = pos_scores.detach().flatten().double()
    neg = neg_scores.detach().flatten().double()
    if pos.numel() == 0 or neg.numel() == 0:
        raise ValueError("fpr_at_tpr needs at least one positive and one negative score")
    k = (tpr_percent * pos.numel() + 99) // 100  # ceil in integers: no float rounding
    threshold = torch.sort(pos, descending=True).values[k - 1]
    return float((neg >= threshold).sum()) / neg.numel()


# --------------------------------------------------------------------------------------------
# Fixed-chunk scoring (the OOD table)
# --------------------------------------------------------------------------------------------
def chunk_scores_all_ranks(model: nn.Module, loader: DataLoader, n: int, runtime: Runtime,
                           score: str, attack: Optional[OODAttack] = None,
                           label: str = "OOD scores") -> Tensor:
    """(n,) float64 scores by position, on every rank (all-gathered). With `attack`, each
    batch is first moved by PGD to raise the score. Every rank must call this."""
    values, positions = [], []
    stops = stop_points_all_ranks(runtime, len(loader))
    for index, (images, pos) in enumerate(progress(loader, runtime, label, total=len(loader))):
        stops.check_all_ranks(index)
        x = images.to(runtime.device)
        if attack is not None:
            x = pgd_attack(model, x, steps=attack.steps, step_size=attack.step_size,
                           eps=attack.eps, norm="L2", objective=attack_objective(score))
        with torch.no_grad():
            values.append(ood_score(model(x), score))
        positions.append(pos.to(runtime.device))
    empty = torch.zeros(0, dtype=torch.float64, device=runtime.device)
    mine = torch.cat(values) if values else empty
    where = torch.cat(positions) if positions else empty.long()
    return all_gather_by_index(runtime, mine, where, n)


def detection_metrics(in_scores: Tensor, ood_scores: Tensor, prefix: str) -> Dict[str, float]:
    """{prefix + "auroc", prefix + "fpr95"} of in- vs out-distribution scores."""
    return {f"{prefix}auroc": float(binary_auc(in_scores, ood_scores)),
            f"{prefix}fpr{TPR_PERCENT}": fpr_at_tpr(in_scores, ood_scores)}


@dataclass(frozen=True)
class OODSettings:
    """What `evaluate_ood_sets_all_ranks` computes (the `eval.ood_*` config fields)."""

    datasets: Sequence[str]
    num_samples: int = 1024
    score: str = "msp"
    adversarial: bool = True
    attack: Optional[OODAttack] = None  # None: original_ood_attack(image size)
    roots: Optional[Dict[str, str]] = None


def ood_settings(evaluation: EvaluationSection) -> OODSettings:
    """The `eval.ood_*` fields; attack budget fields left null take the original's for the
    side the sets are read at (`ood_image_size`)."""
    ev, default = evaluation.eval, original_ood_attack(ood_image_size(evaluation))
    attack = OODAttack(
        eps=default.eps if ev.ood_attack_eps is None else ev.ood_attack_eps,
        steps=default.steps if ev.ood_attack_steps is None else ev.ood_attack_steps,
        step_size=(default.step_size if ev.ood_attack_step_size is None
                   else ev.ood_attack_step_size))
    return OODSettings(tuple(ev.ood_datasets), ev.ood_num_samples, ev.ood_score,
                       ev.ood_adversarial, attack, dict(ev.ood_roots))


def evaluate_ood_sets_all_ranks(model: nn.Module, in_scores: Tensor, settings: OODSettings,
                                runtime: Runtime, *, image_size: int, seed: int, batch_size: int,
                                num_workers: int = 0) -> Dict[str, float]:
    """{"ood/<set>/auroc", "ood/<set>/fpr95", and with settings.adversarial "ood/<set>/adv_auroc",
    "ood/<set>/adv_fpr95"} for every set of settings.datasets, plus their means over the sets
    ("ood/mean/..."). `in_scores`: the in-distribution test scores (all ranks'); the OOD sets
    are read at `image_size` (`ood_image_size`). Every rank must call this."""
    model = unwrap(model)
    score = canonical_score(settings.score)
    attack = settings.attack or original_ood_attack(image_size)
    metrics: Dict[str, float] = {}
    with eval_mode(model):
        for spec in settings.datasets:
            ood = load_ood_set(spec, image_size, seed, settings.num_samples, settings.roots)
            loader = chunk_loader(ood.images, len(ood), batch_size, runtime, num_workers)
            clean = chunk_scores_all_ranks(model, loader, len(ood), runtime, score,
                                           label=f"OOD: {ood.name}")
            metrics.update(detection_metrics(in_scores, clean, f"ood/{ood.name}/"))
            if settings.adversarial:
                adv = chunk_scores_all_ranks(model, loader, len(ood), runtime, score, attack,
                                             label=f"OOD: {ood.name} (attacked)")
                metrics.update(detection_metrics(in_scores, adv, f"ood/{ood.name}/adv_"))
    return {**metrics, **_means(metrics)}


def _means(metrics: Dict[str, float]) -> Dict[str, float]:
    """"ood/mean/<metric>": the mean of "ood/<set>/<metric>" over the sets."""
    by_metric: Dict[str, List[float]] = {}
    for key, value in metrics.items():
        by_metric.setdefault(key.rsplit("/", 1)[1], []).append(value)
    return {f"ood/mean/{name}": float(np.mean(values)) for name, values in by_metric.items()}


# --------------------------------------------------------------------------------------------
# The out-distribution of metric "ood" (rebm/eval/metrics/ood_detection.py)
# --------------------------------------------------------------------------------------------
def gather_scores_all_ranks(runtime: Runtime, local: Tensor) -> Tensor:
    """All ranks' scores on every rank (padded all-gather; order irrelevant for AUROC)."""
    count = torch.tensor([local.shape[0]], device=local.device)
    longest = int(all_reduce_max(runtime, count))
    padded = torch.full((longest, 2), 0.0, dtype=torch.float64, device=local.device)
    padded[:local.shape[0], 0] = local
    padded[:local.shape[0], 1] = 1.0  # validity flag
    everything = all_gather_cat(runtime, padded)
    return everything[everything[:, 1] > 0, 0]


class _FirstN(Dataset):
    """The first n items of a dataset as (x, y, index)."""

    def __init__(self, dataset: Dataset, n: int):
        self.dataset = dataset
        self.n = min(n, len(dataset))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        x, y = self.dataset[index]
        return x, y, index


def build_ood_data(evaluation: EvaluationSection, runtime: Runtime, batch_size: int,
                   num_samples: int, dataset: Optional[Dataset] = None) -> DataLoader:
    """This rank's shard (indices rank, rank+W, ...) of the first `num_samples` images of the
    configured out-distribution (`data.outdist_dataset`), un-augmented, at the original's OOD
    side (`ood_image_size`: 224 px for ImageNet models, the model's own side otherwise), or of
    `dataset`."""
    if dataset is None:
        # "none" (whole image resized to S x S, bicubic; OpenImage-O is not cropped) is what the
        # original's OOD evaluation applies to every out-distribution
        inputs = evaluation.inputs
        at_ood_size = replace(inputs, data=replace(inputs.data,
                                                   image_size=ood_image_size(evaluation)))
        dataset = load_outdist(at_ood_size, augm="none")
    items = _FirstN(dataset, num_samples)
    return DataLoader(items, batch_size=batch_size,
                      sampler=list(eval_shard(len(items), runtime.rank, runtime.world_size)))



# --------------------------------------------------------------------------------------------
# The registered metric "ood_sets"
# --------------------------------------------------------------------------------------------
class OODSets(Metric):
    """OOD detection against `eval.ood_datasets`: AUROC and FPR at 95 % TPR per set, clean and
    adversarial (the module docstring)."""

    name = "ood_sets"
    summary = (("ood/mean/auroc", "OOD-sets mean AUROC", "{:.3f}"),)
    source = TEST_SET
    # 2: noise is the original's noise; ImageNet-size models read the sets at 224 px;
    # restricted_imagenet. 3: float32 scores; non-ImageNet models read the sets at 32 px; the
    # attacks take the original's arithmetic. (Reading other sides at the model's own side
    # changed no value at 32 or 224 px; the side is in the settings, so cached values differ.)
    protocol = 3

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        self.ood = ood_settings(ctx.evaluation)
        self.scores: List[Tensor] = []

    @classmethod
    def settings(cls, evaluation: EvaluationSection) -> Dict[str, Any]:
        ood = ood_settings(evaluation)
        roots = {**DEFAULT_ROOTS, **ood.roots}
        attack = ood.attack
        return {"datasets": list(ood.datasets), "num_samples": ood.num_samples,
                "roots": {d: roots[d] for d in ood.datasets if d in roots},
                "score": canonical_score(ood.score), "subset_seed": evaluation.schedule.rand_seed,
                "image_size": ood_image_size(evaluation),
                "model_image_size": evaluation.data.image_size,
                "attack": ({"norm": "L2", "eps": attack.eps, "steps": attack.steps,
                            "step_size": attack.step_size, "objective": attack_objective(
                                ood.score), "random_start": False}
                           if ood.adversarial else None),
                **test_set_settings(evaluation)}

    @classmethod
    def files(cls, evaluation: EvaluationSection) -> Dict[str, Optional[str]]:
        """The root of every set (named sets: eval.ood_roots.<set>; folders: the folder)."""
        roots = {**DEFAULT_ROOTS, **evaluation.eval.ood_roots}
        found: Dict[str, Optional[str]] = {}
        for spec in evaluation.eval.ood_datasets:
            if spec in roots:
                found[f"eval.ood_roots.{spec}"] = roots[spec]
            elif spec not in OOD_SET_NAMES:  # an image folder
                found[f"eval.ood_datasets[{ood_set_name(spec)}]"] = spec
        return found

    @classmethod
    def problems(cls, evaluation: EvaluationSection) -> List[str]:
        roots = {**DEFAULT_ROOTS, **evaluation.eval.ood_roots}
        return [f"OOD set '{d}': eval.ood_roots.{d} '{roots[d]}' does not exist"
                for d in evaluation.eval.ood_datasets
                if d in roots and not os.path.exists(roots[d])]

    def update(self, batch: TestBatch) -> None:
        self.scores.append(ood_score(batch.logits(), self.ood.score))

    def finish_all_ranks(self) -> Dict[str, Any]:
        ctx, rt = self.ctx, self.ctx.runtime
        local = (torch.cat(self.scores) if self.scores
                 else torch.zeros(0, dtype=torch.float64, device=rt.device))
        return evaluate_ood_sets_all_ranks(ctx.model, gather_scores_all_ranks(rt, local), self.ood,
                                           rt, image_size=ood_image_size(ctx.evaluation),
                                           seed=ctx.evaluation.schedule.rand_seed, batch_size=ctx.batch_size,
                                           num_workers=loader_workers(ctx.evaluation.data, rt))

    @classmethod
    def describe(cls, results: Dict[str, Any], settings: Dict[str, Any]
                 ) -> List[Tuple[str, str, str]]:
        rows = []
        attack = settings["attack"]
        how = (f"{settings['num_samples']} images at {settings.get('image_size')} px, score "
               f"{settings['score']}") + (
            f", attack L2 {attack['eps']:g} in {attack['steps']} steps of {attack['step_size']:g}"
            if attack else "")
        for name in [*(ood_set_name(n) for n in settings["datasets"]), "mean"]:
            key = f"ood/{name}/"
            if f"{key}auroc" not in results:
                continue
            value = f"AUROC {results[key + 'auroc']:.4f}, FPR95 {results[key + 'fpr95']:.4f}"
            if f"{key}adv_auroc" in results:
                value += (f"; attacked {results[key + 'adv_auroc']:.4f}, "
                          f"{results[key + 'adv_fpr95']:.4f}")
            rows.append((f"OOD {name}", value, how))
        return rows
