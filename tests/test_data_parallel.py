"""The one-process DataParallel fallback (use_ddp=false on a multi-GPU machine) runs the attacks
through DataParallel, so all T + K PGD passes are scattered over the GPUs, not only the loss."""

import copy

import pytest
import torch

from rebm.config import load_config, plan_batches
from rebm.data.pipeline import build_train_data
from rebm.distributed.parallel import attack_view
from rebm.distributed.precision import Precision
from rebm.distributed.runtime import Runtime
from rebm.engine.build import build_model_all_ranks
from rebm.engine.optimizers import build_optimizer
from rebm.methods.dat import dat as dat_module
from rebm.methods.dat.dat import DAT
from tests.steps import dat_update

pytestmark = [pytest.mark.timeout(180), pytest.mark.numbers]

CONFIG = "experiments/quickstart/digits.yaml"
SMALL = ["batch_size=16", "attack.start_step=2", "indist_attack_clf.max_steps=2"]


def _step(cfg, runtime, monkeypatch=None):
    """One DAT step from the same weights and batch; returns (result, modules the attacks ran
    on, updated parameters)."""
    torch.manual_seed(0)
    model, raw = build_model_all_ranks(cfg.network, runtime)
    plan = plan_batches(cfg.schedule, cfg.eval, 1)
    batches = next(iter(build_train_data(cfg.inputs, Runtime(), plan, DAT.streams)))
    attacked = []
    if monkeypatch is not None:
        real = dat_module.pgd_from_config

        def record(module, *args, **kwargs):
            attacked.append(module)
            return real(module, *args, **kwargs)

        monkeypatch.setattr(dat_module, "pgd_from_config", record)
    result = dat_update(model, build_optimizer(cfg.optimization, raw.parameters()), batches, 2, cfg, plan,
                      Precision(cfg.distributed.amp, runtime.device))
    return result, attacked, [p.detach().clone() for p in raw.parameters()]


def test_attacks_go_through_data_parallel_and_give_the_same_step(monkeypatch):
    """On CPU DataParallel calls its module directly, so this checks the wiring: the attacks
    are given the DataParallel wrapper, and the step (adversarial examples, losses, update) is
    the plain module's."""
    cfg = load_config(CONFIG, SMALL)
    plain, _, plain_params = _step(cfg, Runtime())
    dp, attacked, dp_params = _step(cfg, Runtime(data_parallel=True), monkeypatch)
    assert attacked and all(isinstance(m, torch.nn.DataParallel) for m in attacked)
    assert torch.equal(plain.previews["train_adv"], dp.previews["train_adv"])
    for name in plain.scores:
        assert torch.equal(plain.scores[name], dp.scores[name]), name
    for name in plain.losses:
        assert torch.equal(plain.losses[name], dp.losses[name]), name
    assert all(torch.equal(a, b) for a, b in zip(plain_params, dp_params, strict=True))


def test_attack_view_strips_ddp_only():
    module = torch.nn.Linear(2, 2)
    dp = torch.nn.DataParallel(module)
    assert attack_view(dp) is dp and attack_view(module) is module


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_every_gpu_does_attack_work():
    """GPU 1 holds activations of the attack passes, and GPU 0's peak is well below that of
    the same attack on one GPU with the whole batch."""
    cfg = load_config(CONFIG, ["batch_size=256", "attack.start_step=10", "device=cuda",
                               "use_ddp=false"])
    model, _ = build_model_all_ranks(cfg.network, Runtime(device=torch.device("cuda", 0), data_parallel=True))
    x = torch.rand(256, 3, 32, 32, device="cuda:0")
    y = torch.randint(0, 10, (256,), device="cuda:0")

    def attack_peaks(net):
        for device in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(device)
        dat_module.pgd_from_config(net, x, cfg.method.attack, steps=10, y=y, objective="logit")
        torch.cuda.synchronize()
        return [torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count())]

    single = attack_peaks(copy.deepcopy(model.module).eval())
    scattered = attack_peaks(attack_view(model).eval())
    assert scattered[1] > 0
    assert scattered[0] < 0.75 * single[0], (scattered, single)
