"""The contract every registered model keeps (docs/design.md §1), written once.

- `forward(x, y=None)` takes images in [0, 1] and returns the logits, or `logits[arange(B), y]`
  when labels `y` are given (the class-conditional score the attacks ascend);
- input normalisation happens inside the model, with `mean`/`std` as non-persistent buffers
  (constants of the data: checkpoints neither carry nor expect them);
- `use_batchnorm=False` keeps every BatchNorm in eval mode while the model trains: the running
  statistics act as a fixed affine map while gamma and beta still learn (DAT stage 2).

A family subclasses `Classifier` (first, before a library class such as timm's), implements
`logits(x)` for images in [0, 1] and calls `init_classifier` at the end of its constructor.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from rebm.models.stats import Stats


class Classifier(nn.Module):
    """Base (or mixin, before a library network class) of every registered model."""

    # (mean, std) used when the builder passes none: the statistics the family is made for
    default_stats: Optional[Stats] = None

    def init_classifier(self, *, normalize_input: bool, use_batchnorm: bool,
                        mean: Optional[Sequence[float]] = None,
                        std: Optional[Sequence[float]] = None) -> None:
        """Set up the contract once the network's layers exist (it applies the BatchNorm rule)."""
        if self.default_stats is None and (mean is None or std is None):
            raise TypeError(f"{type(self).__name__} needs mean and std (it has no default_stats)")
        self.normalize_input = normalize_input
        self.use_batchnorm = use_batchnorm
        mean = self.default_stats[0] if mean is None else tuple(mean)
        std = self.default_stats[1] if std is None else tuple(std)
        # persistent=False: constants of the data, not weights; original checkpoints lack them.
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)
        self.train(self.training)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] -> the network's input."""
        return (x - self.mean) / self.std if self.normalize_input else x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(B, num_classes) logits of images `x` in [0, 1]; each family implements it."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        logits = self.logits(x)
        if y is None:
            return logits
        return logits[torch.arange(logits.shape[0], device=logits.device), y]

    def train(self, mode: bool = True) -> "Classifier":
        """With use_batchnorm=False every BatchNorm stays in eval mode. Wrappers (DDP,
        DataParallel, compile, EMA copies) call this method recursively, so the rule holds
        through them."""
        super().train(mode)
        if mode and not self.use_batchnorm:
            for m in self.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):  # includes SyncBatchNorm
                    m.eval()
        return self
