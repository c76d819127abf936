"""The EMA of the weights warms its decay up as the original does (docs/design.md §1): its first
update copies the weights, the n-th after that averages with decay min(ema_decay, (1 + n) /
(10 + n)), InNOutRobustness' AveragedModel that DAT's train.py builds. Both sides are computed
here, on this machine; they differ only in how the average is rounded (a lerp against the
original's two products), so the comparison has a float32 tolerance."""

from __future__ import annotations

import pytest
import torch

from rebm.config.sections import EmaSection
from rebm.engine.ema import build_ema

pytestmark = pytest.mark.numbers


def original_average(weights, ema_decay):
    """The original's AveragedModel.update_parameters, written out, over a list of weights."""
    average = None
    for n, weight in enumerate(weights):
        if n == 0:
            average = weight.clone()
        else:
            decay = min(ema_decay, (1 + n) / (10 + n))
            average = decay * average + (1.0 - decay) * weight
    return average


def test_the_ema_warms_up_as_the_original():
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    ema = build_ema(model, EmaSection(use_ema=True, ema_decay=0.95))
    seen = []
    for _ in range(200):  # past n = 170, where (1 + n) / (10 + n) reaches 0.95
        with torch.no_grad():
            model.weight.add_(torch.randn_like(model.weight))
        ema.update()
        seen.append(model.weight.detach().clone())
    expected = original_average(seen, 0.95)
    torch.testing.assert_close(ema.ema_model.weight, expected, rtol=1e-5, atol=1e-5)
    assert ema.get_current_decay() == 0.95  # capped at ema_decay


def test_the_decay_at_each_average_is_the_originals():
    model = torch.nn.Linear(2, 2)
    ema = build_ema(model, EmaSection(use_ema=True, ema_decay=0.999))
    ema.update()  # the first update copies the weights
    for n in range(1, 40):
        ema.update()  # the n-th average; the decay it used:
        assert ema.get_current_decay() == min(0.999, (1 + n) / (10 + n))
