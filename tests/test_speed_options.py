"""The speed options (`amp`, `model.channels_last`, `model.compile`) are correct on CPU, and the
attack loop never synchronises with the host (which would stall a GPU at every PGD step)."""

from __future__ import annotations

import contextlib
import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F

from rebm.attacks import pgd as pgd_module
from rebm.attacks.pgd import pgd_attack, pgd_from_config
from rebm.checkpoint.weights import load_checkpoint
from rebm.config import TrainConfig, load_config, plan_batches
from rebm.data.pipeline import build_train_data
from rebm.distributed import Runtime
from rebm.distributed.parallel import strip_parallel, unwrap
from rebm.distributed.precision import Precision
from rebm.engine.build import build_model_all_ranks
from rebm.engine.optimizers import build_optimizer
from rebm.methods.dat.dat import DAT
from rebm.methods.dat.objective import dat_loss, loss_options
from rebm.models import build_model
from tests.steps import dat_update

pytestmark = [pytest.mark.timeout(120), pytest.mark.numbers]

ARCH = "WideResNet10x1"
DEFAULTS = TrainConfig()  # the default loss: energy BCE (0.5, 0, 0.5), logsumexp, fused


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ARCH, 10)


def _batch(seed: int = 1, n: int = 8, size: int = 16):
    g = torch.Generator().manual_seed(seed)
    x_in, x_adv, x_c, x_out = (torch.rand(n, 3, size, size, generator=g) for _ in range(4))
    y_in = torch.randint(0, 10, (n,), generator=g)
    y_c = torch.randint(0, 10, (n,), generator=g)
    return x_in, y_in, x_adv, x_c, y_c, x_out


def _loss_and_grads(model, batch, autocast):
    model.zero_grad(set_to_none=True)
    x_in, y_in, x_adv, x_c, y_c, x_out = batch
    with autocast:
        losses = dat_loss(model, x_in, y_in, x_adv, x_c, y_c, x_out,
                          loss_options(DEFAULTS.method, DEFAULTS.model))
    losses.loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return losses, grads


# ---------------------------------------------------------------------------------------------
# amp
# ---------------------------------------------------------------------------------------------
def test_bf16_autocast_dat_loss_is_close_to_fp32():
    model = _model()
    model.train()  # frozen BatchNorm: eval-mode BN, as DAT trains
    batch = _batch()
    ref, g_ref = _loss_and_grads(model, batch, contextlib.nullcontext())
    low, g_low = _loss_and_grads(model, batch, torch.autocast("cpu", dtype=torch.bfloat16))
    # The losses are reduced in float32 (autocast runs BCE / CE / logsumexp in fp32).
    assert low.loss.dtype == torch.float32
    assert all(term.dtype == torch.float32 for term in low.terms.values())
    # bf16 keeps 8 mantissa bits: ~0.4 % per rounding; the losses agree to a few 1e-2.
    for a, b in ((ref.loss, low.loss), *((ref.terms[k], low.terms[k]) for k in ref.terms)):
        a, b = a.detach(), b.detach()
        assert torch.isfinite(b)
        assert abs(float(a) - float(b)) <= 2e-2 * max(1.0, abs(float(a))), (float(a), float(b))
    # Gradients point the same way and have about the same size.
    cosine = F.cosine_similarity(g_ref, g_low, dim=0)
    assert cosine > 0.99, float(cosine)
    assert abs(g_low.norm() / g_ref.norm() - 1) < 0.05
    # The energy-curriculum scores (AUC inputs) stay close too.
    assert torch.allclose(ref.logit_in, low.logit_in.float(), atol=0.1, rtol=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("amp", ["none", "bf16", "fp16"])
def test_dat_step_runs_under_each_precision(amp):
    """The config's `amp` reaches the step: autocast on the attacks and the loss, GradScaler
    only for fp16, finite losses and an actual parameter update."""
    cfg = load_config("experiments/quickstart/digits.yaml", [
        f"amp={amp}", "batch_size=8", "attack.start_step=2", "indist_attack_clf.max_steps=2"])
    runtime = Runtime()
    plan = plan_batches(cfg.schedule, cfg.eval, 1)
    torch.manual_seed(0)
    model, raw = build_model_all_ranks(cfg.network, runtime)
    optimizer = build_optimizer(cfg.optimization, raw.parameters())
    precision = Precision(cfg.distributed.amp, runtime.device)
    assert precision.scaler.is_enabled() == (amp == "fp16")
    before = [p.detach().clone() for p in raw.parameters()]
    batches = next(iter(build_train_data(cfg.inputs, runtime, plan, DAT.streams)))
    for _ in range(2):
        metrics = dat_update(model, optimizer, batches, 2, cfg, plan, precision)
        assert metrics.finite
        assert metrics.scores["in"].dtype == torch.float32
    assert any(not torch.equal(a, p) for a, p in zip(before, raw.parameters(), strict=True))
    assert all(p.dtype == torch.float32 for p in raw.parameters())  # master weights stay fp32
    state = precision.state_dict()
    assert (state is not None) == (amp == "fp16")


# ---------------------------------------------------------------------------------------------
# channels_last
# ---------------------------------------------------------------------------------------------
def test_channels_last_model_gives_the_same_outputs():
    model = _model().eval()
    fast = copy.deepcopy(model).to(memory_format=torch.channels_last)
    assert fast.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.rand(6, 3, 16, 16)
    with torch.no_grad():
        ref = model(x)
        for inp in (x, x.contiguous(memory_format=torch.channels_last)):
            assert torch.allclose(fast(inp), ref, rtol=1e-6, atol=1e-6)
    # Input gradients (what the attacks use) agree as well.
    xa = x.clone().requires_grad_(True)
    xb = x.clone().requires_grad_(True)
    (ga,) = torch.autograd.grad(model(xa).logsumexp(1).sum(), xa)
    (gb,) = torch.autograd.grad(fast(xb).logsumexp(1).sum(), xb)
    assert torch.allclose(ga, gb, rtol=1e-5, atol=1e-6)


def test_channels_last_config_and_checkpoint_round_trip(tmp_path):
    cfg = load_config("experiments/quickstart/digits.yaml", ["model.channels_last=true"])
    torch.manual_seed(0)
    model, raw = build_model_all_ranks(cfg.network, Runtime())
    assert raw.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    path = tmp_path / "cl.pth"
    torch.save(raw.state_dict(), path)
    plain = build_model(cfg.model.model_type, 10, mean=raw.mean.flatten().tolist(),
                        std=raw.std.flatten().tolist())
    load_checkpoint(plain, str(path))
    x = torch.rand(4, 3, 16, 16)
    with torch.no_grad():
        assert torch.allclose(plain.eval()(x), raw.eval()(x), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# torch.compile (the wrapper only: no inductor compilation, which is slow on CPU)
# ---------------------------------------------------------------------------------------------
def test_compiled_state_dict_loads_into_uncompiled_model(tmp_path):
    model = _model(seed=3).eval()
    compiled = torch.compile(model)  # nothing is compiled until the first call
    state = compiled.state_dict()
    assert all(k.startswith("_orig_mod.") for k in state)
    assert unwrap(compiled) is model
    path = tmp_path / "compiled.pth"
    torch.save(state, path)
    fresh = _model(seed=4).eval()
    report = load_checkpoint(fresh, str(path))
    assert "_orig_mod." in report.layout
    x = torch.rand(4, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


def test_build_model_with_compile_keeps_raw_module_uncompiled():
    cfg = load_config("experiments/quickstart/digits.yaml", ["model.compile=true"])
    torch.manual_seed(0)
    model, raw = build_model_all_ranks(cfg.network, Runtime())
    assert model is not raw and unwrap(model) is raw
    # Optimizer, EMA and checkpoints use `raw`: plain names, shared parameters.
    assert not any(k.startswith("_orig_mod.") for k in raw.state_dict())
    assert {id(p) for p in model.parameters()} == {id(p) for p in raw.parameters()}


def test_attacks_run_on_the_compiled_module(monkeypatch, tmp_path):
    """With model.compile the attacks (T + K of the step's T + K + 1 passes) must go through
    the compiled module, not the plain one `unwrap` returns."""
    from rebm.methods.dat import dat as dat_module

    # fuse_attacks=false: the separate attacks go through pgd_from_config (on a CUDA machine
    # `auto` fuses them into one pass, which tests/test_fused_attacks.py covers)
    cfg = load_config("experiments/quickstart/digits.yaml",
                      ["model.compile=true", "fuse_attacks=false", f"run_dir={tmp_path}"])
    torch.manual_seed(0)
    model, raw = build_model_all_ranks(cfg.network, Runtime())
    assert strip_parallel(model) is model and strip_parallel(torch.nn.DataParallel(model)) is model
    attacked = []

    class Stop(Exception):
        pass

    def record(module, *args, **kwargs):
        attacked.append(module)
        raise Stop  # before the loss pass, which would start a (slow on CPU) inductor compile

    monkeypatch.setattr(dat_module, "pgd_from_config", record)
    plan = plan_batches(cfg.schedule, cfg.eval, 1)
    batch = next(iter(build_train_data(cfg.inputs, Runtime(), plan, DAT.streams)))
    with pytest.raises(Stop):
        dat_update(model, build_optimizer(cfg.optimization, raw.parameters()), batch, 1, cfg, plan,
                 Precision("none", torch.device("cpu")))
    assert attacked == [model] and model is not raw


def _recording_aot_backend(backward_graphs: list):
    """torch.compile backend: AOTAutograd (as inductor uses it) running its graphs eagerly, and
    keeping the code of every backward graph it builds."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def forward_compiler(graph, _inputs):
        return make_boxed_func(graph.forward)

    def backward_compiler(graph, _inputs):
        backward_graphs.append(graph.code)
        return make_boxed_func(graph.forward)

    return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)


def test_compiled_attack_matches_eager_and_computes_no_weight_gradients():
    """A compiled backward computes the gradient of everything that requires one, whatever
    autograd.grad asks for: the attack must switch the parameters' gradients off (else every
    compiled PGD step also computes all weight gradients)."""
    model = _model(seed=5).eval()
    graphs: list = []
    compiled = torch.compile(model, backend=_recording_aot_backend(graphs))
    x, y = torch.rand(4, 3, 16, 16), torch.tensor([0, 3, 5, 9])
    kwargs = dict(steps=3, step_size=0.1, eps=0.5, objective="ce", y=y)
    assert torch.allclose(pgd_attack(compiled, x, **kwargs), pgd_attack(model, x, **kwargs),
                          atol=1e-6)
    # convolution_backward's output_mask is (input, weight, bias)
    masks = re.findall(r"convolution_backward\.default\(.*\[(True|False), (True|False), "
                       r"(True|False)\]\)", "\n".join(graphs))
    assert masks and all(mask == ("True", "False", "False") for mask in masks), set(masks)
    assert all(p.requires_grad for p in model.parameters())  # the flags are restored


# ---------------------------------------------------------------------------------------------
# No host synchronisation inside the attack loop
# ---------------------------------------------------------------------------------------------
class HostSync(AssertionError):
    pass


_SYNCING = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def no_host_sync(monkeypatch):
    """Every Tensor method that copies a value to the host (a device sync on a GPU) raises.
    On CPU nothing syncs, so this stands in for `torch.cuda.set_sync_debug_mode('error')`."""
    for name in _SYNCING:
        def refuse(*args, _name=name, **kwargs):
            raise HostSync(f"host synchronisation: Tensor.{_name}() inside the attack loop")
        monkeypatch.setattr(torch.Tensor, name, refuse)
    try:
        yield
    finally:
        monkeypatch.undo()


def test_the_guard_catches_a_host_sync(monkeypatch):
    t = torch.ones(2)
    with no_host_sync(monkeypatch):
        for fn in (lambda: t.sum().item(), lambda: bool(t.sum() > 0), lambda: float(t.sum()),
                   lambda: t.tolist(), lambda: t.cpu()):
            with pytest.raises(HostSync):
                fn()
    assert t.sum().item() == 2.0  # restored afterwards


@pytest.mark.parametrize("objective", ["logit", "lse", "ce"])
@pytest.mark.parametrize("norm,eps", [("L2", math.inf), ("L2", 0.5), ("Linf", 8 / 255)])
def test_attack_loop_has_no_host_sync(monkeypatch, objective, norm, eps):
    model = _model().eval()
    x = torch.rand(4, 3, 16, 16)
    y = torch.tensor([0, 3, 5, 9])
    keys = torch.arange(4, dtype=torch.int64) * 7919
    with no_host_sync(monkeypatch):
        x_adv = pgd_attack(model, x, steps=3, step_size=0.1, eps=eps, norm=norm,
                           objective=objective, y=y, random_start_keys=keys)
    assert x_adv.shape == x.shape and x_adv.requires_grad is False
    assert float(x_adv.min()) >= 0.0 and float(x_adv.max()) <= 1.0


def test_attack_from_config_under_autocast_has_no_host_sync(monkeypatch):
    cfg = load_config("experiments/quickstart/digits.yaml", ["indist_attack_clf.random_start=true"])
    model = _model().eval()
    x = torch.rand(4, 3, 16, 16)
    y = torch.tensor([1, 2, 3, 4])
    keys = torch.arange(4, dtype=torch.int64)
    with no_host_sync(monkeypatch), torch.autocast("cpu", dtype=torch.bfloat16):
        pgd_from_config(model, x, cfg.method.attack, steps=2, y=y, objective="logit")
        pgd_from_config(model, x, cfg.method.indist_attack_clf, objective="ce", y=y,
                        random_start_keys=keys)


def test_a_sync_added_to_the_loop_would_fail_this_test(monkeypatch):
    """Guard against a vacuous test: an `.item()` slipped into a PGD step is caught."""
    real_step = pgd_module.ascent_step

    def syncing_step(x, grad, step_size, norm):
        if grad.abs().max().item() == 0:  # the kind of check someone might add
            pass
        return real_step(x, grad, step_size, norm)

    monkeypatch.setattr(pgd_module, "ascent_step", syncing_step)
    model = _model().eval()
    x, y = torch.rand(2, 3, 16, 16), torch.tensor([0, 1])
    with pytest.raises(HostSync):
        with no_host_sync(monkeypatch):
            pgd_attack(model, x, steps=1, step_size=0.1, objective="logit", y=y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_attack_loop_has_no_cuda_sync():
    model = _model().cuda().eval()
    x = torch.rand(4, 3, 16, 16, device="cuda")
    y = torch.tensor([0, 3, 5, 9], device="cuda")
    keys = torch.arange(4, dtype=torch.int64, device="cuda")
    pgd_attack(model, x, steps=1, step_size=0.1, eps=0.5, objective="ce", y=y,
               random_start_keys=keys)  # warm-up (lazy init may sync)
    torch.cuda.set_sync_debug_mode("error")
    try:
        pgd_attack(model, x, steps=3, step_size=0.1, eps=0.5, objective="ce", y=y,
                   random_start_keys=keys)
    finally:
        torch.cuda.set_sync_debug_mode("default")
