"""Which network computes the features of FID, the Inception Score and precision/recall, and
whether its weights are the real Inception (docs/evaluation.md, "The Inception weights").

Three kinds, one per run, decided by `image_log` and the environment (`feature_network`):
- `inception`: pytorch-fid's weights file whose size and SHA-256 are the pinned ones below. Only
  these results are stored under `fid`, `inception_score`, `precision`, `recall`, ...
- `unverified`: another weights file of the same shape, accepted only with
  `image_log.unverified_inception: true`; results under `<key>_unverified`, the digest named in
  the settings, the console and the statistics files.
- `standin`: the callable `REBM_FID_FEATURES=module:function` names (no file); results under
  `<key>_standin`.

A weights file is checked once per process (size first, then the digest, which reads 95 MB),
before any network is built from it, wherever it was found.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from rebm.errors import UserError
from rebm.eval import standin

INCEPTION_WEIGHTS_FILE = "pt_inception-2015-12-05-6726825d.pth"
# pytorch-fid's pt_inception-2015-12-05-6726825d.pth (release `fid_weights`) and torch-fidelity's
# weights-inception-2015-12-05-6726825d.pth (release v0.2.0) are one file. Neither library checks
# what it downloads, so its name proves nothing; this digest and size are the ones several
# independent projects that pin their evaluation assets give for it. The 8 hex digits in the
# file names are the digest's first 8 (tests/test_inception_file.py checks both libraries' URLs).
INCEPTION_SHA256 = "6726825d0af5f729cebd5821db510b11b1cfad8faad88a03f1befd49fb9129b2"
INCEPTION_BYTES = 95_628_359

FEATURES_ENV = "REBM_FID_FEATURES"
STANDIN_SPEC = standin.SPEC
UNVERIFIED_KEY = "image_log.unverified_inception"

INCEPTION, UNVERIFIED, STANDIN = "inception", "unverified", "standin"
_SUFFIX = {INCEPTION: "", UNVERIFIED: "_unverified", STANDIN: "_standin"}
_MARK = {INCEPTION: "", UNVERIFIED: "UNVERIFIED Inception weights",
         STANDIN: "STAND-IN features (not Inception)"}


class FIDError(UserError, ValueError):
    """A feature metric cannot be computed: weights or statistics missing, unreadable or not the
    pinned file; one line that names the path, the config key and the fix."""


@dataclass(frozen=True)
class FeatureNetwork:
    """The network of a run's feature metrics: its kind, its weights file and that file's digest
    (None for a stand-in), or the stand-in's `module:function`."""

    kind: str
    weights: Optional[str] = None
    sha256: Optional[str] = None
    spec: Optional[str] = None

    def key(self, name: str) -> str:
        """The results key of metric value `name` computed with this network: `name` for the
        verified Inception, else `name_unverified` / `name_standin`."""
        return name + _SUFFIX[self.kind]

    def describe(self, variant: str = "pool3 (pytorch-fid)") -> str:
        """The network in settings, eval.json and statistics files, e.g. 'Inception-v3 pool3
        (pytorch-fid)' or '... UNVERIFIED weights sha256 <digest>'."""
        if self.kind == STANDIN:
            return f"stand-in {self.spec}"
        name = f"Inception-v3 {variant}"
        return name if self.kind == INCEPTION else f"{name}, UNVERIFIED weights sha256 {self.sha256}"



def marked_keys(key: str) -> Dict[str, str]:
    """{key of the same value by a network other than the verified Inception: its mark}, e.g.
    {'fid_unverified': 'UNVERIFIED Inception weights', 'fid_standin': 'STAND-IN ...'}."""
    return {key + _SUFFIX[kind]: _MARK[kind] for kind in (UNVERIFIED, STANDIN)}


def kind_of(described: str) -> str:
    """The kind of network a `describe()` text names (settings stored in caches and eval.json)."""
    if described.startswith("stand-in"):
        return STANDIN
    return UNVERIFIED if "UNVERIFIED" in described else INCEPTION


def shown_as(described: str, name: str) -> Tuple[str, str]:
    """(results key, console mark) of value `name` computed with the network a settings text
    describes: ('fid', '') for the verified Inception, ('fid_unverified', 'UNVERIFIED
    Inception weights'), ('fid_standin', 'STAND-IN features (not Inception)')."""
    kind = kind_of(described)
    return name + _SUFFIX[kind], _MARK[kind]


def hub_weights_path() -> str:
    """Where pytorch-fid's loader looks for the weights: <torch hub dir>/checkpoints/."""
    return os.path.join(torch.hub.get_dir(), "checkpoints", INCEPTION_WEIGHTS_FILE)


def weights_in_use(configured: Optional[str]) -> Optional[str]:
    """The Inception weights file the feature metrics read (`image_log.inception_weights`, else
    the hub cache), or None when REBM_FID_FEATURES names a stand-in (no file)."""
    if os.environ.get(FEATURES_ENV):
        return None
    return configured or hub_weights_path()


@functools.lru_cache(maxsize=None)
def _sha256(real_path: str, size: int, mtime_ns: int) -> str:
    # keyed by size and modification time too: a file replaced during a process is read again
    digest = hashlib.sha256()
    with open(real_path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def file_sha256(path: str) -> str:
    """The SHA-256 of a file, read once per process while the file stays the same."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    return _sha256(real, stat.st_size, stat.st_mtime_ns)


def missing_weights_message(configured: Optional[str] = None) -> str:
    from pytorch_fid.inception import FID_WEIGHTS_URL

    if configured:
        return (f"image_log.inception_weights '{configured}' does not exist; point it at "
                f"{INCEPTION_WEIGHTS_FILE} (from {FID_WEIGHTS_URL}), or unset it to use "
                f"{hub_weights_path()}")
    return (f"no Inception weights for FID: put {INCEPTION_WEIGHTS_FILE} (from {FID_WEIGHTS_URL}, "
            f"downloaded on a machine with internet) at {hub_weights_path()} or set "
            "image_log.inception_weights=PATH; for a smoke run "
            f"without them, {FEATURES_ENV}={STANDIN_SPEC} computes STAND-IN features, which are "
            "not Inception numbers")


def _not_pinned(path: str, found: str) -> str:
    from pytorch_fid.inception import FID_WEIGHTS_URL

    return (f"Inception weights '{path}' are not the pinned {INCEPTION_WEIGHTS_FILE} ({found}; "
            f"expected {INCEPTION_BYTES:,} bytes, sha256 {INCEPTION_SHA256[:8]}...): download it "
            f"again from {FID_WEIGHTS_URL}, or set {UNVERIFIED_KEY}=true to store this file's "
            "numbers under *_unverified keys")


def _inception(path: str, allow_unverified: bool) -> FeatureNetwork:
    """The network of the weights file `path` (FIDError when missing, or not the pinned file
    and `allow_unverified` is off)."""
    size = os.path.getsize(path)
    if size == INCEPTION_BYTES:
        digest = file_sha256(path)
        if digest == INCEPTION_SHA256:
            return FeatureNetwork(INCEPTION, path, digest)
        found = f"sha256 {digest[:8]}..."
    else:
        digest, found = None, f"{size:,} bytes"
    if not allow_unverified:
        raise FIDError(_not_pinned(path, found))
    return FeatureNetwork(UNVERIFIED, path, digest or file_sha256(path))


def feature_network(image_log) -> FeatureNetwork:
    """The feature network of `image_log` (its inception_weights, unverified_inception) and the
    environment's REBM_FID_FEATURES; FIDError, one line, when the weights are missing or not
    the pinned file (without image_log.unverified_inception)."""
    spec = os.environ.get(FEATURES_ENV)
    if spec:
        return FeatureNetwork(STANDIN, spec=spec)
    path = image_log.inception_weights or hub_weights_path()
    if not os.path.isfile(path):
        raise FIDError(missing_weights_message(image_log.inception_weights))
    return _inception(path, image_log.unverified_inception)


def network_problems(image_log) -> List[str]:
    """What keeps the feature network from being used here (missing or unpinned weights), one
    line each: the feature metrics' `problems`."""
    try:
        feature_network(image_log)
    except FIDError as err:
        return [str(err)]
    return []


def network_key(image_log, name: str) -> str:
    """The results key of `name` under `image_log`'s network; when the network cannot be
    determined (a problem `network_problems` reports), the key of the verified Inception."""
    try:
        return feature_network(image_log).key(name)
    except FIDError:
        return name


def network_description(image_log, variant: str = "pool3 (pytorch-fid)") -> str:
    """`describe()` of `image_log`'s network, or of the weights it names when they cannot be used
    (settings must be computable for `--check` also when a file is missing)."""
    try:
        return feature_network(image_log).describe(variant)
    except FIDError:
        return FeatureNetwork(INCEPTION).describe(variant)
