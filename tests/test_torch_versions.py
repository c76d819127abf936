"""The bridges between the torch releases rebm supports (rebm/distributed/torch_versions.py),
in real processes on whatever torch runs the suite: `make test` on the pinned release, `make
test-oldest` on the lowest one (the tests marked `bridge`)."""

import ast
import datetime
import os
import re

import pytest
import torch
import torch.nn as nn

from rebm import distributed as rd
from rebm.distributed import torch_versions
from rebm.distributed.torch_versions import (
    distributed_data_parallel,
    set_default_group_timeout,
    torch_release,
    unsettable_timeout,
)
from tests.helpers import REPO
from tests.processes import spawn_ranks

pytestmark = [pytest.mark.timeout(180), pytest.mark.bridge]


def _ddp_worker(result_dir: str) -> None:
    """Each rank starts with its own BatchNorm statistics and weights; what do they hold after
    building DDP, after a training forward on rank-own data, and (forward sync on) after an
    eval forward, which updates nothing?"""
    runtime = rd.setup_distributed()
    # the timeout setter of this release (dist.set_timeout from 2.14, _set_pg_timeout before)
    set_default_group_timeout(datetime.timedelta(seconds=120))
    report = {}
    for sync in (False, True):
        torch.manual_seed(runtime.rank)  # different weights on each rank
        net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        net[1].running_mean.fill_(float(runtime.rank))  # different buffers on each rank
        model = distributed_data_parallel(net, forward_sync_buffers=sync)
        built = rd.all_gather_cat(runtime, torch.cat([t.detach().flatten() for t in
                                                      (*net.parameters(), *net.buffers())])[None])
        model.train()(torch.rand(2, 3, 5, 5) + runtime.rank)
        trained = rd.all_gather_cat(runtime, net[1].running_mean[None].clone())
        model.eval()(torch.rand(2, 3, 5, 5))
        evaluated = rd.all_gather_cat(runtime, net[1].running_mean[None].clone())
        report[sync] = {"built_same": torch.equal(built[0], built[1]),
                        "trained_same": torch.equal(trained[0], trained[1]),
                        "eval_same": torch.equal(evaluated[0], evaluated[1])}
    with open(os.path.join(result_dir, f"rank{runtime.rank}.txt"), "w") as fh:
        fh.write(repr(report))
    rd.teardown(runtime)


@pytest.mark.numbers
@pytest.mark.slow
def test_ddp_replicas_start_identical_and_buffers_sync_per_forward_only_when_asked(tmp_path):
    """Identical replicas after wrapping (parameters and buffers from rank 0) on every release;
    `forward_sync_buffers=False` leaves live statistics per rank, True gives every forward
    rank 0's. On torch < 2.13 this is the bridge over `broadcast_buffers`, whose False would
    leave the buffers of the two ranks different right after construction."""
    spawn_ranks(_ddp_worker, 2, str(tmp_path))
    for rank in range(2):
        report = ast.literal_eval((tmp_path / f"rank{rank}.txt").read_text())
        assert report[False] == {"built_same": True, "trained_same": False, "eval_same": False}
        assert report[True] == {"built_same": True, "trained_same": False, "eval_same": True}


def test_the_gloo_timeout_bridge_names_the_releases_that_cannot_shorten_it(monkeypatch):
    assert torch_release() == tuple(int(v) for v in torch.__version__.split(".")[:2])
    for release, gloo_can in (((2, 8), False), ((2, 9), True), ((2, 14), True)):
        monkeypatch.setattr(torch_versions, "torch_release", lambda release=release: release)
        assert (unsettable_timeout("gloo") is None) == gloo_can, release
        assert unsettable_timeout("nccl") is None
    monkeypatch.setattr(torch_versions, "torch_release", lambda: (2, 8))
    assert "ddp_step_timeout_s" in unsettable_timeout("gloo")


def test_the_supported_range_holds_the_running_torch():
    """pyproject.toml's torch range is the one this suite runs on (make test: the pinned upper
    end; make test-oldest: the lower)."""
    from packaging.specifiers import SpecifierSet

    found = re.search(r'"torch(>=([\d.]+)[\w.]*,<([\d.]+))"', (REPO / "pyproject.toml").read_text())
    torch_range, low, high = found.group(1), *(tuple(int(v) for v in bound.split(".")[:2])
                                                for bound in found.groups()[1:])
    assert low <= torch_release() < high, (torch_range, torch.__version__)
    # a container's development build of the lowest release (NGC's form) is in the range
    assert SpecifierSet(torch_range).contains(f"{low[0]}.{low[1]}.0a0+5228986c39.nv25.06")
    assert not SpecifierSet(torch_range).contains(f"{high[0]}.{high[1]}.0")
    oldest = next(line.split(":=")[1].strip() for line in (REPO / "Makefile").read_text()
                  .splitlines() if line.startswith("OLDEST_TORCH :="))
    assert tuple(int(v) for v in oldest.split(".")[:2]) == low  # make test-oldest tests it


@pytest.mark.slow
@pytest.mark.skipif(unsettable_timeout("gloo") is None, reason="this torch's gloo takes the timeout")
def test_a_torch_whose_gloo_keeps_its_timeout_says_so_once_and_trains(tmp_path):
    """torch 2.8 (make test-oldest): the step timeout cannot be applied; the run says so in one
    line per job and trains on."""
    from tests.helpers import CONFIG, FAST, run_train

    out = run_train([CONFIG, *FAST, "max_steps=2"], nproc=2, run_dir=tmp_path / "run",
                    timeout=240).assert_ok().output
    lines = [line for line in out.splitlines() if "cannot shorten the collective timeout" in line]
    assert len(lines) == 1 and "ddp_step_timeout_s" in lines[0], lines
