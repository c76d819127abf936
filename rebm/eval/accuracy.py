"""Clean and robust test accuracy, sharded over ranks.

Every rank evaluates its own shard (indices rank, rank+W, ... from `build_eval_data`, no padding
duplicates); the correct counts and the number of images are summed over ranks with one
all-reduce, so the result equals a single-process evaluation on any world size.

The robust attack is PGD on the cross-entropy with the `indist_attack_clf` threat model. Its
random start (when `random_start` is set) is keyed by the *dataset index* of each image, so an
image gets the same start point whichever rank or batch it lands in.

AutoAttack (optional): used when `torchattacks` is importable and asked for. Its internal
randomness is not keyed per sample, so unlike PGD its result may differ slightly between world
sizes; it is reported under its own key `autoattack_test_acc`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Dict, Iterator, Optional

import numpy as np
import torch
from torch import Tensor, nn

from rebm.attacks.pgd import pgd_from_config
from rebm.data.sampling import sample_keys
from rebm.distributed import Runtime, all_reduce_sum
from rebm.distributed.logs import progress
from rebm.distributed.parallel import unwrap
from rebm.errors import UserError

LOGGER = logging.getLogger("rebm")

# The "epoch" slot of sample_keys separates the random streams of the evaluation attacks.
ROBUST_EVAL_EPOCH = 0


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Eval mode for the duration, then the caller's mode back (the training loop evaluates
    mid-run and must get its train-mode model back)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def index_keys(seed: int, indices: Tensor, epoch: int = ROBUST_EVAL_EPOCH) -> Tensor:
    """Per-sample attack keys from (seed, dataset index): independent of rank and batch."""
    idx = np.asarray(indices.cpu(), dtype=np.int64)
    return torch.from_numpy(sample_keys(seed, "eval", epoch, idx))


class AutoAttackMissing(UserError, ImportError):
    """--autoattack without its package."""


def _autoattack(model: nn.Module, attack_cfg, num_classes: int, seed: int):
    """torchattacks.AutoAttack for the threat model, or None when the package is missing."""
    try:
        import torchattacks  # optional dependency, not in pyproject
    except ImportError:
        raise AutoAttackMissing("AutoAttack was asked for (--autoattack) but the torchattacks "
                                "package is not installed: pip install torchattacks") from None
    return torchattacks.AutoAttack(model, norm=attack_cfg.norm, eps=attack_cfg.eps,
                                   version="standard", n_classes=num_classes, seed=seed)


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def evaluate_accuracy(
    model: nn.Module,
    loader,
    runtime: Runtime,
    attack_cfg=None,
    robust: bool = True,
    seed: int = 0,
    autoattack: bool = False,
    num_classes: Optional[int] = None,
) -> Dict[str, float]:
    """{"test_acc", "robust_test_acc" (when robust and attack_cfg), "n_test"} over all ranks.

    model: the UNWRAPPED module (attacks must never run through DDP); it is put in eval mode for
    the call. loader: this rank's shard, yielding (x, y, dataset_index). Every rank must call
    this (it ends with one all-reduce), also a rank whose shard is empty.
    """
    model = unwrap(model)  # defensive: an attack through DDP could deadlock
    robust = bool(robust and attack_cfg is not None)
    aa = None
    if autoattack and attack_cfg is not None:
        aa = _autoattack(model, attack_cfg, num_classes or 10, seed)
    device = runtime.device
    # [clean correct, robust correct, autoattack correct, images]; int64 so sums are exact
    counts = torch.zeros(4, dtype=torch.int64, device=device)
    with eval_mode(model):
        for x, y, index in progress(loader, runtime, "evaluation", total=len(loader)):
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.no_grad():
                counts[0] += (model(x).argmax(1) == y).sum()
            if robust:
                keys = index_keys(seed, index).to(device)
                x_adv = pgd_from_config(model, x, attack_cfg, objective="ce", y=y,
                                        random_start_keys=keys)
                with torch.no_grad():
                    counts[1] += (model(x_adv).argmax(1) == y).sum()
            if aa is not None:
                x_aa = aa(x, y)
                with torch.no_grad():
                    counts[2] += (model(x_aa).argmax(1) == y).sum()
            counts[3] += y.shape[0]
    # One collective, reached by every rank whatever its shard or options.
    clean, robust_correct, aa_correct, n = all_reduce_sum(runtime, counts).tolist()
    result = {"test_acc": _ratio(clean, n), "n_test": int(n)}
    if robust:
        result["robust_test_acc"] = _ratio(robust_correct, n)
    if aa is not None:
        result["autoattack_test_acc"] = _ratio(aa_correct, n)
    return result
