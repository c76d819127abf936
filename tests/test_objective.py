"""DAT losses: BCE weighting, R1 penalty, fused forwards, micro-batch accumulation."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rebm.config import TrainConfig
from rebm.methods.dat.objective import clf_loss, dat_loss, ebm_loss, energy, loss_weights

pytestmark = pytest.mark.numbers


class TinyNet(nn.Module):
    """2-layer conv net with the model contract forward(x, y=None); smooth, so R1 is smooth."""

    def __init__(self, num_classes: int = 5):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1), nn.SiLU(), nn.Conv2d(6, 6, 3, stride=2, padding=1),
            nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, num_classes),
        )
        self.calls = []  # batch size of every forward

    def forward(self, x, y=None):
        self.calls.append(len(x))
        logits = self.body(x)
        return logits if y is None else logits[torch.arange(len(x)), y]


def make(b=8, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    model = TinyNet().to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    data = dict(
        x_in=torch.rand(b, 3, 6, 6, generator=g, dtype=dtype),
        y_in=torch.randint(0, 5, (b,), generator=g),
        x_adv=torch.rand(b, 3, 6, 6, generator=g, dtype=dtype),
        x_out=torch.rand(b, 3, 6, 6, generator=g, dtype=dtype),
    )
    return model, data


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_energy():
    model, d = make()
    logits = model(d["x_in"])
    torch.testing.assert_close(energy(model, d["x_in"], d["y_in"], True), logits.logsumexp(1))
    assert torch.equal(energy(model, d["x_in"], d["y_in"], False), model(d["x_in"], d["y_in"]))


@pytest.mark.parametrize("logsumexp", [True, False])
def test_default_weights_equal_plain_bce_mean_over_2b(logsumexp):
    model, d = make(dtype=torch.float32)
    weights = loss_weights(TrainConfig().method)
    assert weights == (0.5, 0.0, 0.5)
    out = ebm_loss(model, d["x_in"], d["y_in"], d["x_adv"], d["x_out"], weights=weights,
                   logsumexp=logsumexp)
    logits = model(torch.cat([d["x_in"], d["x_adv"]]))
    y2 = torch.cat([d["y_in"], d["y_in"]])
    s = logits.logsumexp(1) if logsumexp else logits.gather(1, y2[:, None]).squeeze(1)
    target = torch.cat([torch.ones(8), torch.zeros(8)])
    assert torch.equal(out.bce, F.binary_cross_entropy_with_logits(s, target))  # bit for bit
    assert torch.equal(out.loss, out.bce) and out.r1.item() == 0
    assert out.score_out is None and not out.score_in.requires_grad
    torch.testing.assert_close(out.logit_in, logits[:8].gather(1, d["y_in"][:, None]).squeeze(1))


def test_general_weights_and_clean_out_term():
    model, d = make()
    w = (0.2, 0.3, 0.5)
    out = ebm_loss(model, d["x_in"], d["y_in"], d["x_adv"], d["x_out"], weights=w)
    s = {k: energy(model, d[k], None, True) for k in ("x_in", "x_adv", "x_out")}
    bce = F.binary_cross_entropy_with_logits
    ref = (0.2 * bce(s["x_in"], torch.ones(8, dtype=torch.float64))
           + 0.3 * bce(s["x_out"], torch.zeros(8, dtype=torch.float64))
           + 0.5 * bce(s["x_adv"], torch.zeros(8, dtype=torch.float64)))
    torch.testing.assert_close(out.bce, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.score_out, s["x_out"])


def test_fused_forward_counts_and_matches_unfused():
    model, d = make()
    model.calls.clear()
    fused = ebm_loss(model, d["x_in"], d["y_in"], d["x_adv"], d["x_out"])
    assert model.calls == [16]  # one forward over [x_in; x_adv]; x_out skipped (weight 0)
    model.calls.clear()
    sep = ebm_loss(model, d["x_in"], d["y_in"], d["x_adv"], d["x_out"], fused=False)
    assert model.calls == [8, 8]
    torch.testing.assert_close(fused.bce, sep.bce, rtol=1e-12, atol=1e-12)
    model.calls.clear()
    ebm_loss(model, d["x_in"], d["y_in"], d["x_adv"], d["x_out"], weights=(0.4, 0.2, 0.4), r1reg=1.0)
    assert model.calls == [8, 16]  # R1 needs x_in alone; [x_adv; x_out] fused
    with pytest.raises(ValueError, match="x_out"):
        ebm_loss(model, d["x_in"], d["y_in"], d["x_adv"], None, weights=(0.4, 0.2, 0.4))


def test_r1_matches_finite_differences():
    model, d = make(b=3)
    r1reg = 0.7
    out = ebm_loss(model, d["x_in"], d["y_in"], d["x_adv"], r1reg=r1reg)
    # reference gradient of s w.r.t. each input pixel by central differences
    x, h = d["x_in"], 1e-6
    fd = torch.zeros_like(x).flatten(1)
    with torch.no_grad():
        for j in range(fd.shape[1]):
            e = torch.zeros_like(fd)
            e[:, j] = h
            e = e.view_as(x)
            fd[:, j] = (energy(model, x + e, None, True) - energy(model, x - e, None, True)) / (2 * h)
    ref = r1reg * 0.5 * fd.pow(2).sum(1).mean()
    torch.testing.assert_close(out.r1, ref, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(out.loss, out.bce + out.r1)


def test_r1_trains_the_parameters():
    """d r1 / d theta from backward (create_graph) equals central differences in theta."""
    model, d = make(b=3)
    out = ebm_loss(model, d["x_in"], d["y_in"], d["x_adv"], r1reg=1.0)
    out.r1.backward()
    w = model.body[0].weight
    assert w.grad.abs().sum() > 0
    h = 1e-6
    for idx in [(0, 0, 0, 0), (3, 2, 1, 2)]:
        w.data[idx] += h
        up = ebm_loss(model, d["x_in"], d["y_in"], d["x_adv"], r1reg=1.0).r1.detach()
        w.data[idx] -= 2 * h
        down = ebm_loss(model, d["x_in"], d["y_in"], d["x_adv"], r1reg=1.0).r1.detach()
        w.data[idx] += h
        torch.testing.assert_close(w.grad[idx], (up - down) / (2 * h), rtol=1e-5, atol=1e-9)


def test_clf_loss():
    model, d = make()
    out = clf_loss(model, d["x_adv"], d["y_in"])
    torch.testing.assert_close(out.loss, F.cross_entropy(model(d["x_adv"]), d["y_in"]))
    assert not out.logits.requires_grad and out.logits.shape == (8, 5)


@pytest.mark.parametrize("fused", [True, False])
def test_dat_loss_equals_sum_of_parts(fused):
    model, d = make()
    kw = dict(weights=(0.4, 0.2, 0.4), r1reg=0.5, logsumexp=False, fused=fused)
    model.calls.clear()
    out = dat_loss(model, d["x_in"], d["y_in"], d["x_adv"], d["x_out"], d["y_in"], d["x_out"], **kw)
    assert model.calls == ([8, 24] if fused else [8, 8, 8, 8])
    ebm = ebm_loss(model, d["x_in"], d["y_in"], d["x_adv"], d["x_out"], **kw)
    clf = clf_loss(model, d["x_out"], d["y_in"])
    torch.testing.assert_close(out.ebm.loss, ebm.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.clf.loss, clf.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.loss, ebm.loss + clf.loss, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fused", [True, False])
def test_accumulation_reproduces_full_batch_gradient(fused):
    """sum over micro-batches of loss/accum has the full-batch gradient (all terms on)."""
    model, d = make(b=8)
    kw = dict(weights=(0.3, 0.2, 0.5), r1reg=0.5, logsumexp=True, fused=fused)
    x_c, y_c = d["x_out"].flip(0), d["y_in"].flip(0)
    dat_loss(model, d["x_in"], d["y_in"], d["x_adv"], x_c, y_c, d["x_out"], **kw).loss.backward()
    full = grads(model)
    model.zero_grad()
    accum = 4
    for i in range(accum):
        sl = slice(2 * i, 2 * i + 2)
        out = dat_loss(model, d["x_in"][sl], d["y_in"][sl], d["x_adv"][sl], x_c[sl], y_c[sl],
                       d["x_out"][sl], **kw)
        (out.loss / accum).backward()
    for g_full, g_acc in zip(full, grads(model), strict=True):
        torch.testing.assert_close(g_acc, g_full, rtol=0, atol=1e-6)


def test_inputs_are_not_modified():
    model, d = make()
    x_in = d["x_in"].clone()
    ebm_loss(model, d["x_in"], d["y_in"], d["x_adv"], r1reg=1.0).loss.backward()
    assert torch.equal(d["x_in"], x_in) and d["x_in"].grad is None and not d["x_in"].requires_grad
