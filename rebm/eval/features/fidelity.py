"""torch-fidelity's feature network for the Inception Score and precision/recall
(rebm/eval/metrics/inception_score.py, precision_recall.py), offline.

- The network is torch-fidelity's `inception-v3-compat` (`FeatureExtractorInceptionV3`: the
  TF-compatible resize to 299 and its 2048-d pool and 1008 logits). Its weights are the same
  file as FID's (`pt_inception-2015-12-05-6726825d.pth`, the same state dict keys and values as
  torch-fidelity's own download), found and checked as FID's (`image_log.inception_weights`,
  else torch's hub cache; rebm/eval/features/network.py) and handed to torch-fidelity's constructor in place of its URL loader:
  nothing is downloaded, and the file is read with weights_only=True.
- With REBM_FID_FEATURES set, its callable stands in (`StandInExtractor`, a torch-fidelity
  feature extractor with the one feature "standin", used as IS logits and PR features alike);
  the values are then stored under `<key>_standin` (`<key>_unverified` with unverified weights).

Features are computed once per generated chunk for all metrics (`chunk_features`), on the
8-bit samples (uint8, as torch-fidelity reads PNG files; the Inception Score's default protocol
feeds its own PIL-resized copy instead, rebm/eval/metrics/inception_score.py). `FeatureRows` keeps a
rank's rows by sample index and gathers them in index order; `text_order` is the order in which
torch-fidelity reads the `keep_samples` folder (file names `<index>.png` sorted as text), so
rows taken in that order give the numbers of `fidelity --input1 <that folder>` (precision/recall
gathers its rows; the Inception Score keeps only split statistics, inception_score.py).
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import Tensor

from rebm.config.views import EvaluationSection
from rebm.distributed import Runtime, all_reduce_max
from rebm.distributed.collectives import all_gather_by_index
from rebm.eval.features.fid import env_features, offline_loader
from rebm.eval.features.network import (
    STANDIN,
    FIDError,
    feature_network,
    network_description,
)
from rebm.eval.metric import SampleChunk

INCEPTION_NAME = "inception-v3-compat"
STANDIN_NAME = "rebm-standin"
INCEPTION_LAYERS = ["2048", "logits_unbiased"]


def library_version() -> str:
    import torch_fidelity

    return f"torch-fidelity {torch_fidelity.__version__}"


def fidelity_network_name(image_log) -> str:
    """The network of IS and precision/recall in settings (with an unverified file's digest)."""
    return network_description(image_log, f"({INCEPTION_NAME})")


def _standin_class():
    from torch_fidelity.feature_extractor_base import FeatureExtractorBase

    class StandInExtractor(FeatureExtractorBase):
        """The REBM_FID_FEATURES callable as a torch-fidelity feature extractor."""

        def __init__(self, name, features_list, **kwargs):
            super().__init__(name, features_list)
            self.function = env_features()

        def forward(self, x: Tensor):
            return (self.function(x.float() / 255),)

        @staticmethod
        def get_provided_features_list():
            return ("standin",)

        @staticmethod
        def get_default_feature_layer_for_metric(metric):
            return "standin"

        @staticmethod
        def can_be_compiled():
            return False

        @staticmethod
        def get_dummy_input_for_compile():
            return None

    return StandInExtractor


def build_extractor(image_log, device):
    """torch-fidelity's Inception from the checked local weights file (FIDError when missing or
    not the pinned file), or the stand-in; in eval mode on `device`."""
    network = feature_network(image_log)
    if network.kind == STANDIN:
        extractor = _standin_class()(STANDIN_NAME, ["standin"])
    else:
        from torch_fidelity import feature_extractor_inceptionv3 as tf_inception

        try:
            state = torch.load(network.weights, map_location="cpu", weights_only=True)
            with offline_loader(tf_inception, state):
                extractor = tf_inception.FeatureExtractorInceptionV3(INCEPTION_NAME,
                                                                     INCEPTION_LAYERS)
        except Exception as err:  # an unverified file: unpickling, wrong keys or shapes
            raise FIDError(f"Inception weights '{network.weights}' cannot be loaded into "
                           f"torch-fidelity's Inception ({type(err).__name__}: "
                           f"{str(err).strip().splitlines()[0] if str(err).strip() else ''})"
                           ) from None
    return extractor.requires_grad_(False).eval().to(device)


def shared_extractor(evaluation: EvaluationSection, runtime: Runtime, resources: Dict[str, Any]):
    """The run's torch-fidelity feature network for the config's weights, built once into
    an Evaluator's `resources` (at start, `Metric.build`). Keyed by the weights setting:
    metrics of one sample pass may name different weights files (the table's
    metric_overrides)."""
    log = evaluation.image_log
    key = f"fidelity extractor {log.inception_weights} {feature_network(log)}"
    if key not in resources:
        resources[key] = build_extractor(evaluation.image_log, runtime.device)
    return resources[key]


def feature_layer(extractor, metric: str) -> str:
    """The feature a torch-fidelity metric ("isc", "prc") reads from this extractor."""
    return type(extractor).get_default_feature_layer_for_metric(metric)


def extract(extractor, pixels: Tensor) -> Dict[str, Tensor]:
    with torch.no_grad():
        return extractor.convert_features_tuple_to_dict(extractor(pixels))


def chunk_features(chunk: SampleChunk, extractor) -> Dict[str, Tensor]:
    """The chunk's torch-fidelity features, computed once for every metric."""
    return chunk.cached(f"fidelity features {id(extractor)}",
                        lambda: extract(extractor, chunk.pixels()))


def text_order(n: int) -> List[int]:
    """Indices 0..n-1 in the order of their file names `<index>.png` sorted as text."""
    return sorted(range(n), key=lambda i: f"{i}.png")


class FeatureRows:
    """A rank's feature rows by index, gathered on every rank at the end (small next to the
    images: 2048 numbers a sample for precision/recall)."""

    def __init__(self) -> None:
        self.rows: List[Tensor] = []
        self.indices: List[Tensor] = []

    def add(self, indices: Tensor, rows: Tensor) -> None:
        self.rows.append(rows.detach().cpu())
        self.indices.append(indices.cpu())

    def gather_all_ranks(self, runtime: Runtime, total: int) -> Tensor:
        """All ranks' rows (total, D) in index order, in the features' dtype, on the CPU. Every
        rank calls this (also one without rows: D and the dtype come from the others)."""
        mine = torch.cat(self.rows) if self.rows else None
        wide = mine is not None and mine.dtype == torch.float64
        shape = torch.tensor([0 if mine is None else mine.shape[1], int(wide)])
        dims, wide = all_reduce_max(runtime, shape.to(runtime.device)).tolist()
        dtype = torch.float64 if wide else torch.float32
        rows = torch.zeros(0, dims, dtype=dtype) if mine is None else mine.to(dtype)
        idx = torch.cat(self.indices) if self.indices else torch.zeros(0, dtype=torch.int64)
        device = runtime.device
        return all_gather_by_index(runtime, rows.to(device), idx.to(device), total).cpu()
