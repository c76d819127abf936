"""DAT's own config rules: the energy BCE's per-stream weights and their validation.

The config layer only types and loads the fields (`clf_*_weight`, the older `xent_*_weight`
spelling: the original's keys, though they weigh the energy BCE's streams, not the classifier's
loss); what they mean and which values are valid is the method's business.
"""

from __future__ import annotations

from typing import Tuple

from rebm.config import ConfigError
from rebm.config.origins import BUILT_IN_CODE, ConfigOrigins
from rebm.config.sections import MethodSection

# Each stream's weight: its key and the older spelling, which wins when set
ENERGY_BCE_WEIGHT_KEYS = (("clf_indist_weight", "xent_indist_weight"),
                          ("clf_outdist_weight", "xent_outdist_weight"),
                          ("clf_adv_weight", "xent_adv_weight"))


def energy_bce_weight_keys(method: MethodSection) -> Tuple[str, str, str]:
    """The key each stream's weight is read from: the older xent_* spelling when set."""
    return tuple(old if getattr(method, old) is not None else key  # type: ignore[return-value]
                 for key, old in ENERGY_BCE_WEIGHT_KEYS)


def raw_energy_bce_weights(method: MethodSection) -> Tuple[float, float, float]:
    """(in-dist, clean out-dist, adversarial out-dist) weights of the energy BCE as configured
    (the older xent_* spelling wins when set); `energy_bce_weights` normalises them."""
    return tuple(getattr(method, key)  # type: ignore[return-value]
                 for key in energy_bce_weight_keys(method))


def check_energy_bce_weights(method: MethodSection,
                             origins: ConfigOrigins = BUILT_IN_CODE) -> None:
    """A ConfigError naming the keys and where they were set unless every weight is >= 0 and
    their sum positive. A negative weight is blamed on where it was set; a sum that is not
    positive on the command line when it set any of the three."""
    keys, weights = energy_bce_weight_keys(method), raw_energy_bce_weights(method)
    if min(weights) < 0 or sum(weights) <= 0:
        wrong = [k for k, w in zip(keys, weights, strict=True) if w < 0] or list(keys)
        raise ConfigError(
            f"{origins.of(*wrong)}: {', '.join(repr(k) for k in keys)} must be >= 0 with a "
            f"positive sum; got {', '.join(f'{w:g}' for w in weights)}")


def energy_bce_weights(method: MethodSection) -> Tuple[float, float, float]:
    """(in-dist, clean out-dist, adversarial out-dist) weights of the energy BCE, normalised."""
    raw = raw_energy_bce_weights(method)
    total = sum(raw)
    return tuple(w / total for w in raw) if total > 0 else tuple(raw)  # type: ignore[return-value]


def scores_clean_outdist(method: MethodSection) -> bool:
    """The clean out-distribution images get their own term (one more stream in the loss
    pass)."""
    return raw_energy_bce_weights(method)[1] > 0
