"""Stage 1's attack and recipe keys: In-N-Out's argmin PGD (rebm/attacks/argmin_pgd.py) keeps the
best of its K + 1 iterates, the start point included, where plain PGD keeps the last; its first
step is the momentum step written out; `indist_attack_clf.attack_type` chooses it (the stage-1
configs do), `data.cutout_size` sets the Cutout window (8 in the CIFAR-100 stage-1 config, as
In-N-Out's get_CIFAR100), and bad values of either are one-line errors naming the key.
(The whole training step against In-N-Out's own: tests/test_stage1_twin.py.)"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from rebm.attacks.argmin_pgd import argmin_pgd_attack, attack_from_config
from rebm.attacks.pgd import pgd_attack, pgd_from_config
from rebm.config import ConfigError, load_config
from rebm.data.augmentations import Cutout, build_augmentation
from tests.helpers import REPO

STAGE1_CONFIGS = os.path.join(REPO, "InNOutRobustnessMean0_cifar100", "configs")


class Wavy(torch.nn.Module):
    """Two logits +-sin(8 w.x + b): a landscape where a long step often lands lower than it
    started, so the best iterate and the last one differ."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(48, 1)

    def forward(self, x):
        z = torch.sin(8 * self.lin(x.flatten(1)))
        return torch.cat([z, -z], 1)


@pytest.fixture
def wavy():
    torch.manual_seed(0)
    model = Wavy().eval()
    x = torch.rand(64, 3, 4, 4)
    y = torch.randint(0, 2, (64,))
    return model, x, y


def ce(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none").detach()


@pytest.mark.numbers
def test_the_best_iterate_is_kept_the_start_included(wavy):
    model, x, y = wavy
    kw = dict(steps=3, step_size=1.0, eps=2.0)
    best = argmin_pgd_attack(model, x, y, **kw)
    last = pgd_attack(model, x, objective="ce", y=y, **kw)
    assert (ce(model, best, y) >= ce(model, x, y)).all()
    assert (best == x).flatten(1).all(1).sum() > 0  # the clean input won for some samples
    assert (ce(model, last, y) < ce(model, x, y)).sum() > 0  # plain PGD ended lower there
    # more steps: the best of a superset of the same iterates, never lower
    fewer = argmin_pgd_attack(model, x, y, **{**kw, "steps": 2})
    assert (ce(model, best, y) >= ce(model, fewer, y)).all()
    assert ((best - x).flatten(1).norm(dim=1) <= 2.0 + 1e-5).all()
    assert best.min() >= 0 and best.max() <= 1


@pytest.mark.numbers
def test_steps_zero_is_the_input(wavy):
    model, x, y = wavy
    assert torch.equal(argmin_pgd_attack(model, x, y, steps=0, step_size=1.0, eps=2.0), x)


@pytest.mark.numbers
def test_the_first_step_is_in_n_outs_momentum_step(wavy):
    """K = 1: the better of x and x + delta, delta = clamp(x + renorm(a v / ||v||_2), 0, 1) - x
    with v = g / (||g||_1 + 1e-10), g the gradient of the batch-mean cross-entropy
    (In-N-Out's argmin_pgd.py, its loss negated)."""
    model, x, y = wavy
    xg = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(F.cross_entropy(model(xg), y), xg)
    v = g / (1e-10 + g.abs().flatten(1).sum(1).view(-1, 1, 1, 1))
    step = 0.5 * F.normalize(v.flatten(1), dim=1).view_as(v)
    delta = torch.clamp(x + torch.renorm(step, p=2, dim=0, maxnorm=0.3), 0, 1) - x
    stepped = x + delta
    better = (ce(model, stepped, y) > ce(model, x, y)).view(-1, 1, 1, 1)
    expected = torch.where(better, stepped, x)
    got = argmin_pgd_attack(model, x, y, steps=1, step_size=0.5, eps=0.3)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.numbers
def test_attack_type_chooses_the_attack(wavy):
    model, x, y = wavy
    cfg = load_config(None, ["indist_attack_clf.max_steps=2", "indist_attack_clf.step_size=1.0",
                             "indist_attack_clf.eps=2.0"])
    plain = cfg.method.indist_attack_clf
    assert torch.equal(attack_from_config(model, x, plain, objective="ce", y=y),
                       pgd_from_config(model, x, plain, objective="ce", y=y))
    argmin = load_config(None, ["indist_attack_clf.attack_type=argmin_pgd",
                                "indist_attack_clf.max_steps=2",
                                "indist_attack_clf.step_size=1.0",
                                "indist_attack_clf.eps=2.0"]).method.indist_attack_clf
    assert torch.equal(attack_from_config(model, x, argmin, objective="ce", y=y),
                       argmin_pgd_attack(model, x, y, steps=2, step_size=1.0, eps=2.0))
    with pytest.raises(ValueError, match="cross-entropy"):
        attack_from_config(model, x, argmin, objective="logit", y=y)


@pytest.mark.parametrize("override, message", [
    ("attack.attack_type=argmin_pgd", "'attack.attack_type: argmin_pgd' is for indist_attack_clf"),
    ("indist_attack_clf.attack_type=adam", "indist_attack_clf.attack_type"),
    ("data.cutout_size=0", "'data.cutout_size' must be >= 1"),
])
def test_bad_values_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, [override])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name, cutout", [("cifar100_wrn34x10.yaml", 8),
                                          ("cifar10_wrn34x10.yaml", 16)])
def test_the_stage1_configs_are_in_n_outs(name, cutout):
    cfg = load_config(os.path.join(STAGE1_CONFIGS, name))
    attack = cfg.method.indist_attack_clf
    assert (attack.attack_type, attack.max_steps, attack.step_size, attack.eps, attack.norm) == \
        ("argmin_pgd", 10, 0.1, 0.5, "L2")
    assert cfg.data.cutout_size == cutout
    transform = build_augmentation(cfg.data.augm_type_classification, cfg.data.image_size,
                                   cutout_size=cfg.data.cutout_size)
    cutouts = [t for t in transform.transforms if isinstance(t, Cutout)]
    assert [c.size for c in cutouts] == [cutout]


def test_cutout_size_sets_the_erased_square():
    image = torch.ones(3, 32, 32)
    torch.manual_seed(3)
    for size in (8, 16):
        erased = (Cutout(size)(image) == 0).all(0).sum()
        assert 0 < erased <= size * size
    assert build_augmentation("autoaugment_cutout", 32).transforms[-1].size == 16  # unset
