"""FID of generated samples against reference statistics (pytorch-fid `.npz`: `mu`, `sigma`).

The Fréchet distance itself is computed here (`frechet_distance`). The Inception features come
from a maintained library, never from weights this project ships or downloads:
- pytorch-fid (`pip install pytorch-fid`), weights file
  `$TORCH_HOME/hub/checkpoints/pt_inception-2015-12-05-6726825d.pth`;
- torch-fidelity (also what torchmetrics' FID uses), weights file
  `$TORCH_HOME/hub/checkpoints/weights-inception-2015-12-05-6726825d.pth`.
Only a weights file already on disk is used (compute nodes often have no internet, and a
download attempt would hang or crash an evaluation). Without library or weights, or without the
reference file, FID is skipped: one warning, and `compute_fid` returns None — never a crash,
never a made-up number.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional

import numpy as np
import torch
from torch import Tensor

LOGGER = logging.getLogger("rebm")

PYTORCH_FID_WEIGHTS = "pt_inception-2015-12-05-6726825d.pth"
TORCH_FIDELITY_WEIGHTS = "weights-inception-2015-12-05-6726825d.pth"
_warned: set = set()  # each distinct reason is reported once per process


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        LOGGER.warning(message)


# --------------------------------------------------------------------------------------------
# The distance
# --------------------------------------------------------------------------------------------
def frechet_distance(mu1, sigma1, mu2, sigma2, eps: float = 1e-6) -> float:
    """||mu1 - mu2||² + Tr(S1 + S2 - 2 (S1 S2)^½) between two Gaussians.

    (S1 S2)^½ of covariances estimated from few samples can be singular (sqrtm gives inf/nan)
    or pick up tiny imaginary parts from round-off; the former is handled by adding eps·I to
    both covariances, the latter by keeping the real part when the imaginary part is negligible.
    """
    from scipy import linalg

    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    sigma1 = np.atleast_2d(np.asarray(sigma1, np.float64))
    sigma2 = np.atleast_2d(np.asarray(sigma2, np.float64))
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape:
        raise ValueError(f"FID statistics differ in shape: mu {mu1.shape} vs {mu2.shape}, "
                         f"sigma {sigma1.shape} vs {sigma2.shape}")
    diff = mu1 - mu2
    covmean = linalg.sqrtm(sigma1 @ sigma2)
    if not np.isfinite(covmean).all():
        LOGGER.info("FID: singular covariance product; adding %g to the diagonals", eps)
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = linalg.sqrtm((sigma1 + offset) @ (sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError(f"FID: imaginary component {np.abs(covmean.imag).max():.3g} in the "
                             "covariance square root")
        covmean = covmean.real
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2.0 * np.trace(covmean))


def feature_statistics(features: np.ndarray):
    """(mu, sigma) of (N, D) features, in the pytorch-fid convention (unbiased covariance)."""
    features = np.asarray(features, np.float64)
    return features.mean(axis=0), np.cov(features, rowvar=False)


# --------------------------------------------------------------------------------------------
# Inception features from an installed library with local weights
# --------------------------------------------------------------------------------------------
def _local_weights(filename: str) -> Optional[str]:
    path = os.path.join(torch.hub.get_dir(), "checkpoints", filename)
    return path if os.path.isfile(path) else None


def _pytorch_fid_extractor(device: torch.device) -> Optional[Callable[[Tensor], Tensor]]:
    try:
        from pytorch_fid.inception import InceptionV3
    except ImportError:
        return None
    if _local_weights(PYTORCH_FID_WEIGHTS) is None:
        return None
    # With the file in the hub cache, load_state_dict_from_url reads it without a download.
    net = InceptionV3([InceptionV3.BLOCK_INDEX_BY_DIM[2048]]).to(device).eval()
    return lambda x: net(x)[0].flatten(1)  # float [0, 1] input, resized inside


def _torch_fidelity_extractor(device: torch.device) -> Optional[Callable[[Tensor], Tensor]]:
    try:
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
    except ImportError:
        return None
    weights = _local_weights(TORCH_FIDELITY_WEIGHTS)
    if weights is None:
        return None
    net = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"],
                                      feature_extractor_weights_path=weights).to(device).eval()
    return lambda x: net(x.mul(255).round().to(torch.uint8))[0]  # uint8 input


def inception_extractor(device: torch.device) -> Optional[Callable[[Tensor], Tensor]]:
    """Images float [0, 1] (N, 3, H, W) -> (N, 2048) pool features, or None (with one warning)
    when no library with local weights is available."""
    for build in (_pytorch_fid_extractor, _torch_fidelity_extractor):
        extractor = build(device)
        if extractor is not None:
            return extractor
    _warn_once(
        "FID skipped: no Inception network with local weights (install pytorch-fid or "
        f"torch-fidelity and put {PYTORCH_FID_WEIGHTS} / {TORCH_FIDELITY_WEIGHTS} in "
        f"{os.path.join(torch.hub.get_dir(), 'checkpoints')})"
    )
    return None


def load_reference(path: Optional[str]):
    """(mu, sigma) from a pytorch-fid .npz, or None with a warning naming the path."""
    if not path:
        _warn_once("FID skipped: image_log.data_dir (reference statistics .npz) is not set")
        return None
    if not os.path.isfile(path):
        _warn_once(f"FID skipped: reference statistics '{path}' not found (image_log.data_dir; "
                   "a .npz with mu and sigma, e.g. from `python -m pytorch_fid --save-stats`)")
        return None
    try:
        with np.load(path) as ref:
            return ref["mu"], ref["sigma"]
    except (KeyError, ValueError, OSError) as err:
        _warn_once(f"FID skipped: cannot read mu/sigma from '{path}' ({type(err).__name__}: "
                   f"{err})")
        return None


def _features(images: Tensor, extractor, device, batch_size: int) -> Tensor:
    out = []
    with torch.no_grad():
        for start in range(0, images.shape[0], batch_size):
            batch = images[start:start + batch_size].to(device).float()
            out.append(extractor(batch).double())
    return torch.cat(out) if out else torch.zeros(0, 2048, dtype=torch.float64, device=device)


def compute_fid(images: Tensor, ref_stats_path: Optional[str], device, batch_size: int = 100,
                runtime=None) -> Optional[float]:
    """FID of `images` (float [0, 1], N x 3 x H x W) against the reference statistics, or None
    when it cannot be computed here (reason logged once).

    With a distributed `runtime` (every rank holds the same `images` and calls this), rank r
    extracts the features of images r, r+W, ... and the features are all-gathered, so every
    rank returns the same number at 1/W of the Inception cost. Whether FID runs at all is agreed
    by one consensus, so a rank without weights cannot leave the others in a collective.
    """
    from rebm.distributed import consensus

    reference = load_reference(ref_stats_path)
    extractor = inception_extractor(torch.device(device)) if reference is not None else None
    too_few = images.shape[0] < 2
    if runtime is not None and runtime.distributed:
        if consensus(runtime, skip=extractor is None or too_few)["skip"]:
            return None
    elif extractor is None or too_few:
        if too_few and extractor is not None:
            _warn_once(f"FID skipped: needs at least 2 samples, got {images.shape[0]}")
        return None
    if runtime is not None and runtime.distributed:
        from rebm.eval.generation import gather_by_index

        local = torch.arange(runtime.rank, images.shape[0], runtime.world_size)
        mine = _features(images[local], extractor, device, batch_size)
        features = gather_by_index(runtime, mine, local.to(mine.device), images.shape[0])
    else:
        features = _features(images, extractor, device, batch_size)
    mu, sigma = feature_statistics(features.cpu().numpy())
    try:
        return frechet_distance(mu, sigma, *reference)
    except ValueError as err:  # reference of another feature size, imaginary sqrtm, ...
        _warn_once(f"FID skipped: {err} (reference {ref_stats_path})")
        return None
