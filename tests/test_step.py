"""One DAT step under real DDP: the attacks never go through the DDP wrapper."""

import os

import pytest
import torch

from rebm import distributed as rd
from rebm.config import load_config, plan_batches
from rebm.data.pipeline import build_train_data
from rebm.distributed.precision import Precision
from rebm.engine.build import get_model, get_optimizer
from rebm.methods.dat.step import DAT
from tests.processes import spawn_ranks
from tests.steps import dat_update

pytestmark = pytest.mark.timeout(180)


def _worker(result_dir: str, r1reg: float) -> None:
    runtime = rd.setup_distributed()
    cfg = load_config("experiments/quickstart/digits.yaml", [
        "batch_size=16", "per_device_batch_size=4", "attack.start_step=2",
        "indist_attack_clf.max_steps=2", f"r1reg={r1reg}"])
    plan = plan_batches(cfg, runtime.world_size)
    torch.manual_seed(0)
    model, raw = get_model(cfg, runtime)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
    wrapper_calls, raw_calls = [], []
    model.register_forward_pre_hook(lambda *_: wrapper_calls.append(1))
    raw.register_forward_pre_hook(lambda *_: raw_calls.append(1))
    optimizer = get_optimizer(cfg, raw.parameters())
    batches = next(iter(build_train_data(cfg, runtime, plan, DAT.streams)))
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
