"""FID of generated samples against reference statistics, through pytorch-fid (docs/evaluation.md).

- The features are pytorch-fid's `InceptionV3` pool3 features (2048-d). Its weights file
  `pt_inception-2015-12-05-6726825d.pth` is read from `image_log.inception_weights` when set,
  else from the torch hub cache where pytorch-fid looks (`$TORCH_HOME/hub/checkpoints/`), and
  checked against the pinned size and SHA-256 first (rebm/eval/features/network.py; another
  file only with `image_log.unverified_inception`, its results under `<key>_unverified`). It is
  never downloaded: pytorch-fid's loader is handed the local state dict instead of the URL.
- The distance is pytorch-fid's `calculate_frechet_distance`; the reference statistics are a
  pytorch-fid `.npz` with `mu` and `sigma` (`image_log.data_dir`, written by
  `python -m rebm.eval.fid_stats`).
- Another feature network can stand in for Inception (tests, experiments without the weights):
  the environment variable `REBM_FID_FEATURES=module:function` names a callable float [0, 1]
  images (N, 3, H, W) -> (N, D) features; every process then uses it for the samples and for
  `fid_stats` alike (and for IS and precision/recall, rebm/eval/features/fidelity.py). Its results are
  stored under `<key>_standin` (`FeatureNetwork.key`) and labelled as such. rebm ships one,
  `rebm.eval.standin:features` (rebm/eval/standin.py). Statistics files rebm writes name their
  network (`features` in the .npz, with an unverified file's digest) and the recipe that read
  the images (`recipe`), and a run with another network refuses them.

Samples are quantised to 8 bits before the features, as if written to and read from PNG files
(what the original DAT code fed pytorch-fid): by `eval.sample_pixels`, floor(255 x) by default,
byte for byte the PNGs the original wrote with torchvision's `to_pil_image`
(rebm.eval.metric.to_pixels), or rounded. The features are computed sharded, chunk by
chunk as the samples are generated (rebm/eval/metrics/fid.py; chunk k on rank k % W, so an
image's features do not depend on the world size); only sums of the features and of their outer
products are kept (`MomentSums`): each chunk's in float64, added over the chunks and the ranks
as exact fixed-point integers (rebm/eval/exact_sums.py), so every rank gets the same mu and sigma,
bit for bit on any number of processes.

`reference_problems(evaluation)` lists what is missing (the FID metric's `problems`: a `--check`
warning each, one `EvalError` line at the start of a run, rebm/eval/evaluator.py), and the Evaluator
loads the network and the statistics once at start (`fid_scorer`): a broken file fails then,
never a made-up number. A score that cannot be computed (fewer than 2 samples, statistics of
another size) is skipped with one warning, on every rank alike.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from rebm.config.views import EvaluationSection
from rebm.distributed import Runtime
from rebm.eval.exact_sums import ExactSums
from rebm.eval.features.network import (  # noqa: F401  (FIDError and the names are re-exported)
    FEATURES_ENV,
    INCEPTION,
    INCEPTION_WEIGHTS_FILE,
    STANDIN,
    STANDIN_SPEC,
    FeatureNetwork,
    FIDError,
    feature_network,
    hub_weights_path,
    weights_in_use,
)
from rebm.eval.metric import to_pixels

LOGGER = logging.getLogger("rebm")

Features = Callable[[Tensor], Tensor]  # float [0, 1] images (N, 3, H, W) -> (N, D)

INCEPTION_DIMS = 2048
_said: set = set()  # each distinct notice is logged once per process
_INCEPTION: Dict[str, torch.nn.Module] = {}  # weights path -> network, built once


class Statistics(NamedTuple):
    """A reference .npz: mu, sigma, and what rebm recorded of how they were made (None in files
    from pytorch-fid or the original code)."""

    mu: np.ndarray
    sigma: np.ndarray
    features: Optional[str]  # FeatureNetwork.describe() of the network
    recipe: Optional[str]  # how the images were read (rebm.eval.fid_stats --recipe)


def _say_once(message: str, level: int = logging.WARNING) -> None:
    if message not in _said:
        _said.add(message)
        LOGGER.log(level, message)


def _warn_once(message: str) -> None:
    _say_once(message)


# --------------------------------------------------------------------------------------------
# The distance and the statistics
# --------------------------------------------------------------------------------------------
def frechet_distance(mu1, sigma1, mu2, sigma2, eps: float = 1e-6) -> float:
    """pytorch-fid's Fréchet distance ||mu1 - mu2||² + Tr(S1 + S2 - 2 (S1 S2)^½), as a float.

    Shapes are checked here (pytorch-fid only asserts). Its notice on a singular covariance
    product goes to the log instead of stdout; scipy's deprecation of the `disp` argument that
    pytorch-fid 0.3 passes is silenced.
    """
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    sigma1 = np.atleast_2d(np.asarray(sigma1, np.float64))
    sigma2 = np.atleast_2d(np.asarray(sigma2, np.float64))
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape:
        raise ValueError(f"FID statistics differ in shape: mu {mu1.shape} vs {mu2.shape}, "
                         f"sigma {sigma1.shape} vs {sigma2.shape}")
    from pytorch_fid import fid_score  # scipy.linalg and friends: imported when needed

    notice = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(notice):
        warnings.filterwarnings("ignore", message=".*disp.*", category=DeprecationWarning)
        value = fid_score.calculate_frechet_distance(mu1, sigma1, mu2, sigma2, eps=eps)
    if notice.getvalue().strip():
        LOGGER.info("FID: %s", notice.getvalue().strip())
    return float(value)


def feature_statistics(features) -> Tuple[np.ndarray, np.ndarray]:
    """(mu, sigma) of (N, D) features, as pytorch-fid computes them (unbiased covariance)."""
    features = np.asarray(features, np.float64)
    return features.mean(axis=0), np.cov(features, rowvar=False)


def to_8bit(images: Tensor, mode: str = "round") -> Tensor:
    """Images quantised to 8 bits as float k / 255: `to_pixels(images, mode)` ("round": what
    torchvision's save_image writes; "floor": what to_pil_image writes)."""
    return to_pixels(images, mode).float().div(255)


class MomentSums:
    """What FID keeps of a set of images, whatever its size: the count, the sum and the sum of
    outer products of their feature rows, as one (D+1) x (D+1) moment matrix, the sum over the
    added batches of [1, x]^T [1, x] (its corner is the count, its first row the sum, the rest
    the outer products). Each batch's matrix is one float64 product of that batch; the batches'
    matrices are added exactly (rebm/eval/exact_sums.py), so the totals do not depend on the
    order of the batches or on which rank added which. Fed the same batches (evaluation chunks,
    the same on any world size), mu and sigma are the same bits on any number of processes.
    `statistics_all_ranks` combines the ranks."""

    def __init__(self) -> None:
        self.moments = ExactSums()

    def add(self, feats: Tensor) -> None:
        feats = feats.detach().flatten(1).double()
        rows = torch.cat([feats.new_ones(feats.shape[0], 1), feats], dim=1)
        self.moments.add(rows.T @ rows)

    def statistics_all_ranks(self, runtime: Runtime) -> Tuple[np.ndarray, np.ndarray]:
        """(mu, sigma) of all ranks' rows together (unbiased covariance). Every rank must call
        this, also one that added nothing; ValueError with fewer than 2 rows in all, or with
        moments beyond the exact sums' range (features of about 7e3 at 50,000 images)."""
        total = self.moments.total_all_ranks(runtime)
        if total is None or total[0, 0] < 2:
            got = 0 if total is None else int(total[0, 0])
            raise ValueError(f"FID statistics need at least 2 images, got {got}")
        moments = total.cpu().numpy()
        n, s1, s2 = moments[0, 0], moments[0, 1:], moments[1:, 1:]
        mu = s1 / n
        sigma = (s2 - n * np.outer(mu, mu)) / (n - 1)
        return mu, (sigma + sigma.T) / 2


def moments_statistics_all_ranks(feature_batches: Iterable[Tensor], runtime: Runtime
                                 ) -> Tuple[np.ndarray, np.ndarray]:
    """(mu, sigma) of all ranks' feature batches together (MomentSums). Every rank must call
    this, with any number of batches (also none)."""
    sums = MomentSums()
    for feats in feature_batches:
        sums.add(feats)
    return sums.statistics_all_ranks(runtime)


# --------------------------------------------------------------------------------------------
# Feature networks: pytorch-fid's Inception from a local, checked file, or a stand-in
# --------------------------------------------------------------------------------------------
@contextmanager
def offline_loader(module, state_dict: dict):
    """`module` (pytorch-fid's or torch-fidelity's Inception module) builds its network with
    `load_state_dict_from_url(URL)`; for the duration of the construction it gets the local
    state dict instead (no network, no unpickling of arbitrary objects)."""
    original = module.load_state_dict_from_url
    module.load_state_dict_from_url = lambda *args, **kwargs: state_dict
    try:
        yield
    finally:
        module.load_state_dict_from_url = original


def inception_network(path: str) -> torch.nn.Module:
    """pytorch-fid's InceptionV3 (FID variant, pool3 block) with the weights of `path`, built
    once per process (on the CPU; move it with `.to`)."""
    from pytorch_fid import inception
    from pytorch_fid.inception import InceptionV3

    if path not in _INCEPTION:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            with offline_loader(inception, state):
                net = InceptionV3([InceptionV3.BLOCK_INDEX_BY_DIM[INCEPTION_DIMS]])
        except Exception as err:  # unpickling, truncated file, wrong keys or shapes
            text = str(err).strip().splitlines()
            raise FIDError(f"Inception weights '{path}' cannot be loaded into pytorch-fid's "
                           f"InceptionV3 ({type(err).__name__}: {text[0] if text else ''}); "
                           f"use the original {INCEPTION_WEIGHTS_FILE}") from None
        _INCEPTION[path] = net.eval()
    return _INCEPTION[path]


def env_features() -> Optional[Features]:
    """The stand-in named by REBM_FID_FEATURES=module:function, or None when it is unset."""
    spec = os.environ.get(FEATURES_ENV)
    if not spec:
        return None
    module_name, _, name = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise FIDError(f"{FEATURES_ENV}='{spec}' does not name an importable module:function "
                       f"({type(err).__name__}: {err})") from None
    if not callable(found):
        raise FIDError(f"{FEATURES_ENV}='{spec}' is not callable")
    return found


def feature_extractor(device, image_log) -> Features:
    """The features of `image_log`'s network (`feature_network`: the REBM_FID_FEATURES stand-in,
    or pool3 of Inception from its checked weights file; FIDError when there is none)."""
    network = feature_network(image_log)
    if network.kind == STANDIN:
        return env_features()
    net = inception_network(network.weights).to(device)
    return lambda images: net(images)[0].flatten(1)


# --------------------------------------------------------------------------------------------
# Reference statistics and start-up checks
# --------------------------------------------------------------------------------------------
def _make_stats_hint(path: str) -> str:
    return f"make it with `python -m rebm.eval.fid_stats CONFIG --out {path}`"


def read_statistics(path: str, key: str = "image_log.data_dir") -> Statistics:
    """The statistics in the .npz at `path`, with their record when rebm wrote them; FIDError
    naming `key` when the file is missing or not a .npz with mu and sigma. Nothing is unpickled."""
    if not os.path.isfile(path):
        raise FIDError(f"{key} '{path}' (FID reference statistics) does not exist; "
                       f"{_make_stats_hint(path)}")
    try:
        with np.load(path) as ref:
            mu, sigma = np.asarray(ref["mu"], np.float64), np.asarray(ref["sigma"], np.float64)
            record = {name: str(ref[name]) for name in ("features", "recipe") if name in ref.files}
    except Exception as err:  # not a zip, no mu/sigma key, pickled object arrays, ...
        raise FIDError(f"{key} '{path}' is not a .npz with mu and sigma "
                       f"({type(err).__name__}: {err}); {_make_stats_hint(path)}") from None
    return Statistics(mu, sigma, record.get("features"), record.get("recipe"))


def statistics_network(path: str, stats: Statistics) -> str:
    """The network `stats` were computed with: their record, or, for a file without one (from
    pytorch-fid or the original code), the verified Inception's (said once per file)."""
    if stats.features is not None:
        return stats.features
    verified = FeatureNetwork(INCEPTION).describe()
    _say_once(f"'{path}' does not record its feature network (a pytorch-fid or original file): "
              f"read as statistics of the verified {verified}", logging.INFO)
    return verified


def load_reference(path: Optional[str], network: Optional[FeatureNetwork] = None,
                   dims: Optional[int] = None, key: str = "image_log.data_dir"
                   ) -> Tuple[np.ndarray, np.ndarray]:
    """(mu, sigma) of a pytorch-fid .npz; FIDError naming `key` when it is not set, missing,
    unreadable, made by another network than `network` (when given), or not (D,) / (D, D)
    (with D = `dims` when given)."""
    if not path:
        raise FIDError(f"{key} (FID reference statistics .npz) is not set; "
                       f"{_make_stats_hint('STATS.npz')} and set {key}=STATS.npz")
    stats = read_statistics(path, key)
    mu, sigma = stats.mu, stats.sigma
    want = dims or (mu.shape[0] if mu.ndim == 1 else -1)
    if mu.shape != (want,) or sigma.shape != (want, want):
        expect = f"({dims},) and ({dims}, {dims})" if dims else "(D,) and (D, D)"
        raise FIDError(f"{key} '{path}' holds mu {mu.shape} and sigma "
                       f"{sigma.shape}, expected {expect}; {_make_stats_hint(path)}")
    for name, array in (("mu", mu), ("sigma", sigma)):
        bad = int((~np.isfinite(array)).sum())
        if bad:  # FID would be NaN, stored as null
            raise FIDError(f"{key} '{path}' holds {bad} NaN or infinite value(s) in '{name}'; "
                           f"{_make_stats_hint(path)}")
    if network is not None:
        made_with, computes = statistics_network(path, stats), network.describe()
        if made_with != computes:
            raise FIDError(f"'{path}' holds statistics of {made_with} features, but this run "
                           f"computes {computes} features; FID compares only the same network's: "
                           f"{_make_stats_hint(path)} with the same weights")
    return mu, sigma


def write_statistics(path: str, mu: np.ndarray, sigma: np.ndarray, features: str, recipe: str
                     ) -> None:
    """A pytorch-fid .npz (mu, sigma) that also records the network (`features`: its
    `describe()`) and the recipe that read the images; written through a temporary file and
    os.replace (never a half-written file)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp.npz")
    np.savez(tmp, mu=mu, sigma=sigma, features=np.array(features), recipe=np.array(recipe))
    os.replace(tmp, path)


def weights_files(image_log) -> Dict[str, Optional[str]]:
    """{'image_log.inception_weights': the file in use}, or {} with a stand-in (Metric.files)."""
    path = weights_in_use(image_log.inception_weights)
    return {} if path is None else {"image_log.inception_weights": path}


def reference_problems(evaluation: EvaluationSection) -> List[str]:
    """What FID lacks here whenever it is asked for: a usable feature network, and reference
    statistics of that network (checked as far as they can be without it)."""
    problems: List[str] = []
    try:
        network: Optional[FeatureNetwork] = feature_network(evaluation.image_log)
    except FIDError as err:
        problems.append(f"{err} (or image_log.log_fid=false: no FID)")
        network = None
    dims = None if network is not None and network.kind == STANDIN else INCEPTION_DIMS
    try:
        load_reference(evaluation.image_log.data_dir, network, dims)
    except FIDError as err:
        problems.append(str(err))
    return problems


# --------------------------------------------------------------------------------------------
# FID of images
# --------------------------------------------------------------------------------------------
class FIDScorer:
    """The FID of sets of images against one reference, on every rank: feed the images' features
    into a MomentSums (`add`), then `score` it (all ranks together)."""

    def __init__(self, features: Features, reference: Tuple[np.ndarray, np.ndarray],
                 runtime: Runtime, batch_size: int, label: str = "the reference",
                 pixel_mode: str = "floor"):
        self.features = features
        self.reference = reference
        self.runtime = runtime
        self.batch_size = batch_size
        self.label = label
        self.pixel_mode = pixel_mode  # eval.sample_pixels

    def add(self, sums: MomentSums, images: Tensor) -> None:
        """The features of float [0, 1] images (quantised to 8 bits by `pixel_mode`) into `sums`."""
        self.add_pixels(sums, to_pixels(images.to(self.runtime.device), self.pixel_mode))

    def add_pixels(self, sums: MomentSums, pixels: Tensor) -> None:
        """The features of uint8 NCHW images into `sums`, read as pytorch-fid reads a PNG
        (ToTensor: k / 255 in float32)."""
        with torch.no_grad():
            sums.add(self.features(pixels.to(self.runtime.device).float().div(255)))

    def score_all_ranks(self, sums: MomentSums) -> Optional[float]:
        """FID of the images in every rank's `sums`, or None with one warning when there are
        fewer than 2 or the statistics do not match the reference (same answer on every rank).
        Every rank must call this."""
        try:
            mu, sigma = sums.statistics_all_ranks(self.runtime)
        except ValueError as err:
            _warn_once(f"FID skipped: {err}")
            return None
        try:
            return frechet_distance(mu, sigma, *self.reference)
        except ValueError as err:  # another feature size, imaginary sqrtm
            _warn_once(f"FID skipped: {err} (reference {self.label}; remake it with "
                       "`python -m rebm.eval.fid_stats`)")
            return None


def fid_scorer(evaluation: EvaluationSection, runtime: Runtime, batch_size: int,
               resources: Dict[str, Any]) -> FIDScorer:
    """The scorer of the config's FID (image_log.data_dir, inception_weights, sample pixels),
    its feature network and reference statistics taken from `resources` (an Evaluator's, built
    there on first use: FIDError, one line, when missing or unreadable). Rank-local."""
    log = evaluation.image_log
    network = feature_network(log)
    key = f"fid features {network}"
    if key not in resources:
        resources[key] = feature_extractor(runtime.device, log)
    reference = f"fid reference {log.data_dir} {network}"
    if reference not in resources:
        resources[reference] = load_reference(log.data_dir, network)
    return FIDScorer(resources[key], resources[reference], runtime, batch_size,
                     str(log.data_dir), evaluation.eval.sample_pixels)
