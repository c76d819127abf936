"""DAT losses through `dat_loss`, what training calls: BCE weighting, R1 penalty, fused forwards,
micro-batch accumulation, each term against its definition."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rebm.config import ConfigError, TrainConfig
from rebm.config.origins import ConfigOrigins
from rebm.methods.dat import DAT
from rebm.methods.dat.objective import (
    TERMS,
    dat_loss,
    energy,
    energy_bce_weights,
    loss_options,
    r1_penalty,
)

pytestmark = pytest.mark.numbers

DEFAULTS = TrainConfig()


def options(fused=True, **method_keys):
    """The options training passes (`loss_options`) for a method section with these keys."""
    method = dataclasses.replace(DEFAULTS.method, **method_keys)
    return loss_options(method, dataclasses.replace(DEFAULTS.model, use_batchnorm=not fused))


WEIGHTS_WITH_CLEAN_OUT = dict(clf_indist_weight=0.4, clf_outdist_weight=0.2, clf_adv_weight=0.4)


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
        x_clf=torch.rand(b, 3, 6, 6, generator=g, dtype=dtype),
        y_clf=torch.randint(0, 5, (b,), generator=g),
    )
    return model, data


def loss(model, d, opts, x_out=True):
    return dat_loss(model, d["x_in"], d["y_in"], d["x_adv"], d["x_clf"], d["y_clf"],
                    d["x_out"] if x_out else None, opts)


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_energy():
    model, d = make()
    logits = model(d["x_in"])
    torch.testing.assert_close(energy(model, d["x_in"], d["y_in"], True), logits.logsumexp(1))
    assert torch.equal(energy(model, d["x_in"], d["y_in"], False), model(d["x_in"], d["y_in"]))


def test_terms_are_the_logged_names_in_order():
    """The step logs each term as train_<name>_loss; these names are the metrics' keys."""
    assert [t.name for t in TERMS] == ["ebm_binary", "r1", "clf"]
    assert {t.name: t.weight_key for t in TERMS} == {"ebm_binary": None, "r1": "r1reg", "clf": None}
    model, d = make()
    assert list(loss(model, d, options()).terms) == ["ebm_binary", "r1", "clf"]


@pytest.mark.parametrize("logsumexp", [True, False])
def test_default_weights_equal_plain_bce_mean_over_2b(logsumexp):
    model, d = make(dtype=torch.float32)
    assert energy_bce_weights(DEFAULTS.method) == (0.5, 0.0, 0.5)
    model.calls.clear()
    out = loss(model, d, options(logsumexp=logsumexp))
    assert model.calls == [24]  # one forward over [x_in; x_adv; x_clf]; x_out skipped (weight 0)
    logits = model(torch.cat([d["x_in"], d["x_adv"], d["x_clf"]]))  # the same forward
    y2 = torch.cat([d["y_in"], d["y_in"]])
    s = logits[:16].logsumexp(1) if logsumexp else logits[:16].gather(1, y2[:, None]).squeeze(1)
    target = torch.cat([torch.ones(8), torch.zeros(8)])
    bce = F.binary_cross_entropy_with_logits(s, target)
    assert torch.equal(out.terms["ebm_binary"], bce)  # bit for bit
    assert out.terms["r1"].item() == 0
    assert torch.equal(out.terms["clf"], F.cross_entropy(logits[16:], d["y_clf"]))
    assert torch.equal(out.loss, bce + out.terms["clf"])
    assert not out.logit_in.requires_grad
    torch.testing.assert_close(out.logit_in, logits[:8].gather(1, d["y_in"][:, None]).squeeze(1))


def test_general_weights_and_clean_out_term():
    model, d = make()
    out = loss(model, d, options(clf_indist_weight=0.2, clf_outdist_weight=0.3,
                                 clf_adv_weight=0.5))
    s = {k: energy(model, d[k], None, True) for k in ("x_in", "x_adv", "x_out")}
    bce = F.binary_cross_entropy_with_logits
    ref = (0.2 * bce(s["x_in"], torch.ones(8, dtype=torch.float64))
           + 0.3 * bce(s["x_out"], torch.zeros(8, dtype=torch.float64))
           + 0.5 * bce(s["x_adv"], torch.zeros(8, dtype=torch.float64)))
    torch.testing.assert_close(out.terms["ebm_binary"], ref, rtol=1e-12, atol=1e-12)


def test_fused_forward_counts_and_matches_unfused():
    model, d = make()
    model.calls.clear()
    fused = loss(model, d, options())
    model.calls.clear()
    sep = loss(model, d, options(fused=False))
    assert model.calls == [8, 8, 8]
    for name in ("ebm_binary", "clf"):
        torch.testing.assert_close(fused.terms[name], sep.terms[name], rtol=1e-12, atol=1e-12)
    model.calls.clear()
    loss(model, d, options(r1reg=1.0, **WEIGHTS_WITH_CLEAN_OUT))
    assert model.calls == [8, 24]  # R1 needs x_in alone; [x_adv; x_out; x_clf] fused
    with pytest.raises(ValueError, match="x_out"):
        loss(model, d, options(**WEIGHTS_WITH_CLEAN_OUT), x_out=False)


def test_r1_matches_finite_differences():
    model, d = make(b=3)
    r1reg = 0.7
    out = loss(model, d, options(r1reg=r1reg))
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
    torch.testing.assert_close(out.terms["r1"], ref, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(out.loss, sum(out.terms.values()))


def test_r1_trains_the_parameters():
    """d r1 / d theta from backward (create_graph) equals central differences in theta."""
    model, d = make(b=3)
    out = loss(model, d, options(r1reg=1.0))
    out.terms["r1"].backward()
    w = model.body[0].weight
    assert w.grad.abs().sum() > 0
    h = 1e-6
    for idx in [(0, 0, 0, 0), (3, 2, 1, 2)]:
        w.data[idx] += h
        up = loss(model, d, options(r1reg=1.0)).terms["r1"].detach()
        w.data[idx] -= 2 * h
        down = loss(model, d, options(r1reg=1.0)).terms["r1"].detach()
        w.data[idx] += h
        torch.testing.assert_close(w.grad[idx], (up - down) / (2 * h), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("fused", [True, False])
def test_each_term_equals_its_definition_and_the_loss_their_sum(fused):
    model, d = make()
    r1reg = 0.5
    model.calls.clear()
    out = loss(model, d, options(fused=fused, r1reg=r1reg, logsumexp=False,
                                 **WEIGHTS_WITH_CLEAN_OUT))
    assert model.calls == ([8, 24] if fused else [8, 8, 8, 8])
    s = {k: energy(model, d[k], d["y_in"], False) for k in ("x_in", "x_adv", "x_out")}
    bce = F.binary_cross_entropy_with_logits
    ebm_binary = (0.4 * bce(s["x_in"], torch.ones(8, dtype=torch.float64))
                  + 0.2 * bce(s["x_out"], torch.zeros(8, dtype=torch.float64))
                  + 0.4 * bce(s["x_adv"], torch.zeros(8, dtype=torch.float64)))
    r1 = r1reg * r1_penalty(model, d["x_in"], d["y_in"], logsumexp=False)
    clf = F.cross_entropy(model(d["x_clf"]), d["y_clf"])
    for name, ref in (("ebm_binary", ebm_binary), ("r1", r1), ("clf", clf)):
        torch.testing.assert_close(out.terms[name], ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(out.loss, (out.terms["ebm_binary"] + out.terms["r1"]) + out.terms["clf"])


@pytest.mark.parametrize("fused", [True, False])
def test_accumulation_reproduces_full_batch_gradient(fused):
    """sum over micro-batches of loss/accum has the full-batch gradient (all terms on)."""
    model, d = make(b=8)
    opts = options(fused=fused, r1reg=0.5, clf_indist_weight=0.3, clf_outdist_weight=0.2,
                   clf_adv_weight=0.5)
    loss(model, d, opts).loss.backward()
    full = grads(model)
    model.zero_grad()
    accum = 4
    for i in range(accum):
        sl = slice(2 * i, 2 * i + 2)
        (loss(model, {k: v[sl] for k, v in d.items()}, opts).loss / accum).backward()
    for g_full, g_acc in zip(full, grads(model), strict=True):
        torch.testing.assert_close(g_acc, g_full, rtol=0, atol=1e-6)


def test_inputs_are_not_modified():
    model, d = make()
    x_in = d["x_in"].clone()
    loss(model, d, options(r1reg=1.0)).loss.backward()
    assert torch.equal(d["x_in"], x_in) and d["x_in"].grad is None and not d["x_in"].requires_grad


def test_a_negative_term_weight_is_refused_naming_its_key():
    """At start-up and under --check (DAT.check_config), for every term with a weight key."""
    method = dataclasses.replace(DEFAULTS.method, r1reg=-0.5)
    with pytest.raises(ConfigError, match=r"^run\.yaml: 'r1reg' must be >= 0, got -0\.5$"):
        DAT.check_config(method, DEFAULTS.model, DEFAULTS.schedule, ConfigOrigins("run.yaml"))
