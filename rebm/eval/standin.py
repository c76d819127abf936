"""A stand-in for Inception, for tests and smoke runs on machines without the Inception weights:

    REBM_FID_FEATURES=rebm.eval.standin:features python -m rebm.eval.fid_stats CONFIG --out S.npz

It is a small fixed function of the pixels, not a network: numbers computed with it are not
Inception numbers and never pass for them. Every result it gives is stored under a `*_standin` key
and labelled STAND-IN on the console, and the statistics files it makes carry its name, so an
Inception FID refuses them (docs/evaluation.md, "Without the Inception weights").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SPEC = "rebm.eval.standin:features"  # what REBM_FID_FEATURES is set to


def features(images: torch.Tensor) -> torch.Tensor:
    """15 features per image in float64: the colour means of its 2x2 quadrants and each
    channel's spread. Float64 and per-image, so an image's features do not depend on its batch
    (the sharded evaluation gives the numbers of one process)."""
    x = images.double()
    return torch.cat([F.adaptive_avg_pool2d(x, 2).flatten(1), x.flatten(2).std(dim=2)], dim=1)
