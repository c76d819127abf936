"""OOD-detection AUROC: in-distribution test images (positives) vs out-distribution images
(negatives), scored by max-softmax or by logsumexp of the logits.

Sharded like accuracy: each rank scores its shard; the scores are all-gathered (padded to the
largest shard, padding dropped) so every rank computes the AUROC on the full sets — AUROC is not
a sum, but it does not depend on the order of the scores, so the result is the single-process one.

Adversarial OOD (optional): the OOD inputs are first moved by PGD to *raise* their score —
"lse" ascends logsumexp, "max_softmax" ascends the logit of the class predicted on the clean
input (a close, cheaper surrogate of the max-softmax). Random starts are keyed by dataset index.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from rebm.attacks.pgd import pgd_from_config
from rebm.data.sampling import eval_shard
from rebm.distributed import Runtime, all_gather_cat, all_reduce_max
from rebm.distributed.logs import progress
from rebm.distributed.parallel import unwrap
from rebm.eval.accuracy import eval_mode, index_keys
from rebm.eval.auc import binary_auc

SCORES = ("max_softmax", "lse")
OOD_ATTACK_EPOCH = 1  # key stream of the OOD attack, distinct from the robust-accuracy attack


def ood_score(logits: Tensor, score: str) -> Tensor:
    if score == "max_softmax":
        return logits.softmax(dim=1).max(dim=1).values
    if score == "lse":
        return torch.logsumexp(logits, dim=1)
    raise ValueError(f"score must be one of {SCORES}, got {score!r}")


def _attack_ood(model: nn.Module, x: Tensor, index: Tensor, attack_cfg, score: str,
                seed: int) -> Tensor:
    keys = index_keys(seed, index, epoch=OOD_ATTACK_EPOCH).to(x.device)
    if score == "lse":
        return pgd_from_config(model, x, attack_cfg, objective="lse", random_start_keys=keys)
    with torch.no_grad():
        target = model(x).argmax(dim=1)
    return pgd_from_config(model, x, attack_cfg, objective="logit", y=target,
                           random_start_keys=keys)


def _local_scores(model: nn.Module, loader, runtime: Runtime, score: str,
                  attack_cfg=None, seed: int = 0) -> Tensor:
    scores = []
    for batch in progress(loader, runtime, "OOD scores", total=len(loader)):
        x, index = batch[0].to(runtime.device), batch[-1]
        if attack_cfg is not None:
            x = _attack_ood(model, x, index, attack_cfg, score, seed)
        with torch.no_grad():
            scores.append(ood_score(model(x), score).double())
    return torch.cat(scores) if scores else torch.zeros(0, dtype=torch.float64,
                                                        device=runtime.device)


def gather_scores(runtime: Runtime, local: Tensor) -> Tensor:
    """All ranks' scores on every rank (padded all-gather; order irrelevant for AUROC)."""
    count = torch.tensor([local.shape[0]], device=local.device)
    longest = int(all_reduce_max(runtime, count))
    padded = torch.full((longest, 2), 0.0, dtype=torch.float64, device=local.device)
    padded[:local.shape[0], 0] = local
    padded[:local.shape[0], 1] = 1.0  # validity flag
    everything = all_gather_cat(runtime, padded)
    return everything[everything[:, 1] > 0, 0]


def evaluate_ood(
    model: nn.Module,
    in_loader,
    ood_loader,
    runtime: Runtime,
    score: str = "max_softmax",
    attack_cfg=None,
    seed: int = 0,
) -> Dict[str, float]:
    """{"ood_auroc"} (and "adv_ood_auroc" when attack_cfg is given) over all ranks.

    Loaders yield this rank's shard as (x, y, dataset_index) batches. Every rank must call this.
    """
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    model = unwrap(model)
    with eval_mode(model):
        pos = gather_scores(runtime, _local_scores(model, in_loader, runtime, score))
        neg = gather_scores(runtime, _local_scores(model, ood_loader, runtime, score))
        adv = None
        if attack_cfg is not None:
            adv = gather_scores(runtime, _local_scores(model, ood_loader, runtime, score,
                                                       attack_cfg, seed))
    result = {"ood_auroc": float(binary_auc(pos, neg))}
    if adv is not None:
        result["adv_ood_auroc"] = float(binary_auc(pos, adv))
    return result


# --------------------------------------------------------------------------------------------
# The out-distribution evaluation set
# --------------------------------------------------------------------------------------------
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


def build_ood_data(cfg, runtime: Runtime, batch_size: int, num_samples: int,
                   dataset: Optional[Dataset] = None) -> DataLoader:
    """This rank's shard (indices rank, rank+W, ...) of the first `num_samples` images of the
    configured out-distribution (`data.outdist_dataset`), un-augmented, or of `dataset`."""
    if dataset is None:
        from rebm.data.pipeline import load_outdist

        # "none" (whole image resized to S x S, bicubic; OpenImage-O is not cropped) is what the
        # original's OOD evaluation applies to every out-distribution
        dataset = load_outdist(cfg, augm="none")
    items = _FirstN(dataset, num_samples)
    return DataLoader(items, batch_size=batch_size,
                      sampler=list(eval_shard(len(items), runtime.rank, runtime.world_size)))
