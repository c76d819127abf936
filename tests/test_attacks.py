"""PGD: step geometry, projection, objectives, parameter gradients untouched, keyed random start."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rebm.attacks import keyed_uniform, pgd_attack, pgd_from_config, random_start
from rebm.config import AttackConfig

pytestmark = pytest.mark.numbers


class TinyNet(nn.Module):
    """2-layer conv net with the model contract forward(x, y=None)."""

    def __init__(self, num_classes: int = 5):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.SiLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1),
            nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes),
        )

    def forward(self, x, y=None):
        logits = self.body(x)
        return logits if y is None else logits[torch.arange(len(x)), y]


@pytest.fixture
def model():
    torch.manual_seed(0)
    return TinyNet().double().eval()


def mid_images(b=4, seed=1):
    """Images in [0.3, 0.7]: small steps never hit the [0, 1] clamp."""
    g = torch.Generator().manual_seed(seed)
    return (0.3 + 0.4 * torch.rand(b, 3, 8, 8, generator=g)).double()


def labels(b=4):
    return torch.arange(b) % 5


def input_grad(model, x, objective, y):
    x = x.clone().requires_grad_(True)
    logits = model(x)
    if objective == "logit":
        loss = logits.gather(1, y[:, None]).sum()
    elif objective == "lse":
        loss = torch.logsumexp(logits, 1).sum()
    else:  # the original's pgd_attack_xent: the mean over the batch given
        loss = F.cross_entropy(logits, y)
    return torch.autograd.grad(loss, x)[0]


def norms(v):
    return v.flatten(1).norm(dim=1)


@pytest.mark.parametrize("objective", ["logit", "lse", "ce"])
def test_parameter_grads_untouched(model, objective):
    params = list(model.parameters())
    for i, p in enumerate(params[:-1]):
        p.grad = torch.full_like(p, float(i + 1))
    before = [None if p.grad is None else p.grad.clone() for p in params]
    pgd_attack(model, mid_images(), steps=3, step_size=0.1, objective=objective, y=labels())
    for p, g in zip(params, before, strict=True):
        if g is None:
            assert p.grad is None
        else:
            assert torch.equal(p.grad, g)


def original_step(x, x0, g, step_size, eps, norm):
    """One step of the original's PGD written out (its rebm/attacks/attack_steps.py at fb2ffc7:
    L2Step.step :147-155 then L2Step.project :141-145; LinfStep.step :121-124 then
    LinfStep.project :115-119)."""
    if norm == "L2":
        g_norm = torch.norm(g.reshape(g.shape[0], -1), dim=1).reshape(-1, *([1] * (x.dim() - 1)))
        x = x + g / (g_norm + 1e-10) * step_size
        diff = (x - x0).renorm(p=2, dim=0, maxnorm=eps)
        return torch.clamp(x0 + diff, 0, 1)
    x = x + torch.sign(g) * step_size
    diff = torch.clamp(x - x0, -eps, eps)
    return torch.clamp(diff + x0, 0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("norm,eps", [("L2", math.inf), ("L2", 0.05), ("Linf", math.inf),
                                      ("Linf", 0.02)])
def test_steps_are_the_originals_bit_for_bit(model, dtype, norm, eps):
    """Three steps equal the original's formulas written out, to the bit, on this machine."""
    model = model.to(dtype)
    x0, y = mid_images().to(dtype), labels()
    ref = x0
    for _ in range(3):
        ref = original_step(ref, x0, input_grad(model, ref, "ce", y), 0.04, eps, norm)
    x_adv = pgd_attack(model, x0, steps=3, step_size=0.04, eps=eps, norm=norm, objective="ce", y=y)
    assert torch.equal(x_adv, ref)


def test_l2_step_has_norm_alpha(model):
    """The step is a*g/(||g|| + 1e-10): norm a up to the original's 1e-10 offset."""
    x, y = mid_images(), labels()
    x1 = pgd_attack(model, x, steps=1, step_size=0.05, objective="logit", y=y)
    assert ((x1 > 0) & (x1 < 1)).all()  # clamp inactive
    g = input_grad(model, x, "logit", y)
    g_norm = norms(g)
    torch.testing.assert_close(norms(x1 - x), 0.05 * g_norm / (g_norm + 1e-10), rtol=0,
                               atol=1e-12)
    torch.testing.assert_close(x1 - x, 0.05 * g / g_norm.view(-1, 1, 1, 1), rtol=0, atol=1e-9)


def test_zero_gradient_gives_zero_step():
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 5))
    with torch.no_grad():
        model[1].weight.zero_()
    x = mid_images().float()
    assert torch.equal(pgd_attack(model, x, steps=2, step_size=0.1, objective="lse"), x)


def test_linf_sign_step(model):
    x, y = mid_images(), labels()
    x1 = pgd_attack(model, x, steps=1, step_size=0.01, norm="Linf", objective="ce", y=y)
    g = input_grad(model, x, "ce", y)
    torch.testing.assert_close(x1 - x, 0.01 * g.sign(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("norm", ["L2", "Linf"])
def test_projection_to_eps_ball(model, norm):
    g = torch.Generator().manual_seed(3)
    x, y, eps = torch.rand(6, 3, 8, 8, generator=g).double(), labels(6), 0.05
    x_adv = pgd_attack(model, x, steps=6, step_size=0.04, eps=eps, norm=norm, objective="ce", y=y)
    dist = norms(x_adv - x) if norm == "L2" else (x_adv - x).abs().flatten(1).amax(1)
    assert (dist <= eps + 1e-9).all()
    assert (dist >= eps - 1e-3).any()  # the constraint is actually reached
    assert x_adv.min() >= 0 and x_adv.max() <= 1


def test_eps_inf_only_clamps(model):
    """With eps = inf a big step is cut only by the [0, 1] clamp (reference step by hand: the
    original's arithmetic, the round trip x0 + (x - x0) included)."""
    x, y = mid_images(), labels()
    x1 = pgd_attack(model, x, steps=1, step_size=5.0, eps=math.inf, objective="logit", y=y)
    g = input_grad(model, x, "logit", y)
    stepped = x + g / (norms(g).view(-1, 1, 1, 1) + 1e-10) * 5.0
    assert torch.equal(x1, (x + (stepped - x)).clamp(0, 1))
    assert (x1 == 0).any() and (x1 == 1).any()


def test_zero_steps_return_input(model):
    x = mid_images()
    for keys in (None, torch.arange(4)):
        out = pgd_attack(model, x, steps=0, step_size=1.0, eps=0.1, y=labels(), random_start_keys=keys)
        assert torch.equal(out, x) and out.data_ptr() != x.data_ptr() and not out.requires_grad


def test_ce_ascent_increases_ce(model):
    g = torch.Generator().manual_seed(5)
    x, y = torch.rand(16, 3, 8, 8, generator=g).double(), torch.randint(0, 5, (16,), generator=g)
    x_adv = pgd_attack(model, x, steps=10, step_size=0.2, eps=1.0, objective="ce", y=y)
    with torch.no_grad():
        before = F.cross_entropy(model(x), y, reduction="none")
        after = F.cross_entropy(model(x_adv), y, reduction="none")
    assert after.mean() > before.mean() and (after > before).float().mean() >= 0.9


@pytest.mark.parametrize("objective", ["logit", "lse"])
def test_logit_and_lse_ascent_increase(model, objective):
    g = torch.Generator().manual_seed(6)
    x, y = torch.rand(16, 3, 8, 8, generator=g).double(), torch.randint(0, 5, (16,), generator=g)
    x_adv = pgd_attack(model, x, steps=10, step_size=0.2, objective=objective, y=y)

    def value(z):
        logits = model(z)
        return logits.gather(1, y[:, None]).squeeze(1) if objective == "logit" else logits.logsumexp(1)

    with torch.no_grad():
        before, after = value(x), value(x_adv)
    assert (after > before).all()


def test_mode_kept_and_no_grad_context(model):
    bn_model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(5))
    bn_model(torch.rand(2, 3, 8, 8))  # materialise the lazy layer
    for train in (True, False):
        bn_model.train(train)
        with torch.no_grad():  # e.g. called from evaluation code
            out = pgd_attack(bn_model, torch.rand(2, 3, 8, 8), steps=2, step_size=0.1, objective="lse")
        assert bn_model.training is train and all(m.training is train for m in bn_model.modules())
        assert not out.requires_grad


def test_missing_labels_and_bad_args(model):
    with pytest.raises(ValueError, match="needs the labels"):
        pgd_attack(model, mid_images(), steps=1, step_size=0.1, objective="ce")
    with pytest.raises(ValueError, match="norm"):
        pgd_attack(model, mid_images(), steps=1, step_size=0.1, norm="L1", objective="lse")


@pytest.mark.parametrize("norm,eps", [("L2", 0.5), ("Linf", 0.03), ("L2", math.inf)])
def test_random_start_keyed_per_sample(norm, eps):
    g = torch.Generator().manual_seed(7)
    x = torch.rand(5, 3, 8, 8, generator=g)
    keys = torch.tensor([3, 17, 2**40 + 1, -5, 123456789])
    full = random_start(x, keys, eps, norm)
    perm = torch.tensor([4, 1, 3])
    other = torch.rand(2, 3, 8, 8, generator=g)
    # the same samples in another order, next to different companions, give the same noise
    mixed = random_start(torch.cat([x[perm], other]), torch.cat([keys[perm], torch.tensor([8, 9])]), eps, norm)
    assert torch.equal(mixed[:3], full[perm])
    assert torch.equal(random_start(x, keys, eps, norm), full)  # no global RNG involved
    assert not torch.equal(random_start(x, keys + 1, eps, norm), full)
    assert full.min() >= 0 and full.max() <= 1
    if not math.isinf(eps):
        dist = norms(full - x) if norm == "L2" else (full - x).abs().flatten(1).amax(1)
        assert (dist <= eps + 1e-6).all() and (dist > 0).all()


def test_keyed_uniform_statistics():
    u = keyed_uniform(torch.arange(64), 4096)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    # distinct keys give uncorrelated rows
    assert abs(torch.corrcoef(torch.stack([u[0], u[1]]))[0, 1]) < 0.1


def test_attack_with_random_start_is_batch_independent(model):
    x, y = mid_images(6), labels(6)
    keys = torch.arange(100, 106)
    kwargs = dict(steps=3, step_size=0.05, eps=0.2, objective="logit", random_start_keys=None)
    full = pgd_attack(model, x, y=y, **{**kwargs, "random_start_keys": keys})
    idx = torch.tensor([5, 0, 2])
    part = pgd_attack(model, x[idx], y=y[idx], **{**kwargs, "random_start_keys": keys[idx]})
    torch.testing.assert_close(part, full[idx], rtol=0, atol=1e-12)


def test_pgd_from_config(model):
    x, y = mid_images(), labels()
    cfg = AttackConfig(max_steps=2, step_size=0.05, eps=0.1, norm="L2")
    ref = pgd_attack(model, x, steps=2, step_size=0.05, eps=0.1, objective="ce", y=y)
    assert torch.equal(pgd_from_config(model, x, cfg, objective="ce", y=y), ref)
    cfg.random_start = True
    with pytest.raises(ValueError, match="random_start_keys"):
        pgd_from_config(model, x, cfg, objective="ce", y=y)
    out = pgd_from_config(model, x, cfg, objective="ce", y=y, steps=0, random_start_keys=torch.arange(4))
    assert torch.equal(out, x)
