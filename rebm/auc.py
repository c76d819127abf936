"""ROC-AUC on the device, exact and without host synchronisation.

Hand-written rather than sklearn's roc_auc_score: it runs every training step on the device
(DAT's curriculum) and must give the same float on any world size for the same scores.
"""

from __future__ import annotations

import torch
from torch import Tensor


def binary_auc(pos_scores: Tensor, neg_scores: Tensor) -> Tensor:
    """ROC-AUC of positives vs negatives (Mann-Whitney U, ties count 1/2), a float64 scalar.

    Equals sklearn.metrics.roc_auc_score on [pos; neg] with labels [1..1; 0..0]. Fully in torch
    and without host synchronisation: for every positive, count the negatives below it and
    those equal to it by binary search in the sorted negatives.
    """
    pos = pos_scores.detach().flatten().contiguous()
    neg = neg_scores.detach().flatten()
    if pos.numel() == 0 or neg.numel() == 0:
        raise ValueError("binary_auc needs at least one positive and one negative score")
    neg = torch.sort(neg.to(pos.dtype)).values
    below = torch.searchsorted(neg, pos, right=False)  # negatives < p
    below_or_equal = torch.searchsorted(neg, pos, right=True)  # negatives <= p
    twice_u = (below + below_or_equal).sum()  # exact in int64: 2*U = sum(2*below + equal)
    return twice_u.to(torch.float64) / (2.0 * pos.numel() * neg.numel())
