"""One DAT step under real DDP: the attacks never go through the DDP wrapper."""

import os

import pytest
import torch

from rebm import distributed as rd
from rebm.config import load_config, plan_batches
from rebm.data.pipeline import build_train_data
from rebm.distributed.precision import Precision
from rebm.engine.build import build_model_all_ranks
from rebm.engine.optimizers import build_optimizer
from rebm.methods.dat.dat import DAT
from tests.processes import spawn_ranks
from tests.steps import dat_update

pytestmark = [pytest.mark.timeout(180), pytest.mark.numbers]


def _worker(result_dir: str, r1reg: float) -> None:
    runtime = rd.setup_distributed()
    cfg = load_config("experiments/quickstart/digits.yaml", [
        "batch_size=16", "per_device_batch_size=4", "attack.start_step=2",
        "indist_attack_clf.max_steps=2", f"r1reg={r1reg}"])
    plan = plan_batches(cfg.schedule, cfg.eval, runtime.world_size)
    torch.manual_seed(0)
    model, raw = build_model_all_ranks(cfg.network, runtime)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
    wrapper_calls, raw_calls = [], []
    model.register_forward_pre_hook(lambda *_: wrapper_calls.append(1))
    raw.register_forward_pre_hook(lambda *_: raw_calls.append(1))
    optimizer = build_optimizer(cfg.optimization, raw.parameters())
    batches = next(iter(build_train_data(cfg.inputs, runtime, plan, DAT.streams)))
    metrics = dat_update(model, optimizer, batches, 2, cfg, plan, Precision("none", runtime.device))
    params = torch.cat([p.detach().flatten() for p in raw.parameters()])
    with open(os.path.join(result_dir, f"rank{runtime.rank}.txt"), "w") as fh:
        fh.write(repr((len(wrapper_calls), len(raw_calls), metrics.finite,
                       params.double().sum().item(), params.double().square().sum().item())))
    rd.teardown(runtime)


@pytest.mark.slow
@pytest.mark.parametrize("r1reg", [0.0, 1.0])
def test_attacks_bypass_ddp_and_ranks_stay_identical(tmp_path, r1reg):
    spawn_ranks(_worker, 2, str(tmp_path), r1reg)
    results = [eval((tmp_path / f"rank{r}.txt").read_text()) for r in range(2)]
    assert results[0] == results[1]  # identical parameters on both ranks after the step
    wrapper_calls, raw_calls, finite, _, _ = results[0]
    accumulation = 16 // (4 * 2)
    # The wrapper is called only for the loss forward(s) of each micro-batch: 1 fused forward,
    # or 2 with r1 (x_in apart). Attacks (2 steps each) call the raw module only.
    assert wrapper_calls == accumulation * (2 if r1reg else 1)
    assert raw_calls == wrapper_calls + accumulation * (2 + 2)
    assert finite


def _clipped_update(max_grad_norm):
    """One single-process DAT update from the same weights and batch; returns (result, the
    gradients it applied, the updated parameters)."""
    cfg = load_config("experiments/quickstart/digits.yaml", [
        "batch_size=16", "per_device_batch_size=8", "attack.start_step=1",
        "indist_attack_clf.max_steps=1", "optimizer=sgd", f"max_grad_norm={max_grad_norm}"])
    runtime = rd.Runtime()
    plan = plan_batches(cfg.schedule, cfg.eval, 1)
    torch.manual_seed(0)
    model, raw = build_model_all_ranks(cfg.network, runtime)
    optimizer = build_optimizer(cfg.optimization, raw.parameters())
    batches = next(iter(build_train_data(cfg.inputs, runtime, plan, DAT.streams)))
    result = dat_update(model, optimizer, batches, 1, cfg, plan, Precision("none", runtime.device))
    grads = torch.cat([p.grad.flatten() for p in raw.parameters()])
    return result, grads, [p.detach().clone() for p in raw.parameters()]


def test_max_grad_norm_bounds_the_update_and_reports_the_norm():
    """Clipping scales the accumulated gradients to max_grad_norm before the optimizer step and
    reports the norm before clipping; a bound above that norm changes nothing, bit for bit."""
    off, grads_off, params_off = _clipped_update("null")
    assert off.grad_norm is None and off.applied
    loose, grads_loose, params_loose = _clipped_update(1e9)
    assert loose.grad_norm == pytest.approx(float(grads_off.norm()), rel=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(params_off, params_loose, strict=True))
    bound = loose.grad_norm / 4
    tight, grads_tight, params_tight = _clipped_update(bound)
    assert tight.grad_norm == loose.grad_norm  # the norm before clipping
    assert float(grads_tight.norm()) == pytest.approx(bound, rel=1e-4)
    assert torch.allclose(grads_tight, grads_off * (bound / loose.grad_norm), atol=1e-7)
    assert not all(torch.equal(a, b) for a, b in zip(params_off, params_tight, strict=True))


@pytest.mark.slow
def test_max_grad_norm_is_logged_as_grad_norm(tmp_path):
    """Through the real entry point: every training record has the step's grad_norm."""
    from tests.helpers import CONFIG, FAST, read_metrics, run_train

    run_train([CONFIG, *FAST, "max_steps=2", "max_grad_norm=0.5"], run_dir=tmp_path / "run",
              timeout=200).assert_ok()
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]  # the first step logs too (the original's)
    assert all(r["grad_norm"] > 0 for r in records)
