"""DAT's own config rules: the energy BCE's per-stream weights and their validation.

The config layer only types and loads the fields (`clf_*_weight`, the older `xent_*_weight`
spelling: the original's keys, though they weigh the energy BCE's streams, not the classifier's
loss); what they mean and which values are valid is the method's business.
"""

from __future__ import annotations

from typing import Tuple

from rebm.config import ConfigError
from rebm.config.sections import MethodSection


def raw_energy_bce_weights(method: MethodSection) -> Tuple[float, float, float]:
    """(in-dist, clean out-dist, adversarial out-dist) weights of the energy BCE as configured
    (the older xent_* spelling wins when set); `energy_bce_weights` normalises them."""
    return (
        method.xent_indist_weight if method.xent_indist_weight is not None
        else method.clf_indist_weight,
        method.xent_outdist_weight if method.xent_outdist_weight is not None
        else method.clf_outdist_weight,
        method.xent_adv_weight if method.xent_adv_weight is not None else method.clf_adv_weight,
    )


def check_energy_bce_weights(method: MethodSection) -> None:
    """A ConfigError naming the keys unless every weight is >= 0 and their sum positive."""
    weights = raw_energy_bce_weights(method)
    if min(weights) < 0 or sum(weights) <= 0:
        raise ConfigError(
            "'clf_indist_weight', 'clf_outdist_weight', 'clf_adv_weight' must be >= 0 with a "
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
