"""Exact sums (rebm/eval/exact_sums.py) and what they give the sample metrics: FID, IS and
precision/recall the same bits on any number of processes.

- `ExactSums`: totals independent of the order of the adds, within float64
  round-off of the exact sum, one error on every rank out of range; real processes where a rank
  adds nothing;
- `MomentSums` (FID): the same mu and sigma whatever the order of the chunks;
- the real entry point, `rebm.eval.evaluate --samples` with 500 stand-in samples on 1, 2 and 3
  processes (torchrun): FID, IS and precision/recall identical.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest
import torch

from rebm import distributed as rd
from rebm.distributed import Runtime
from rebm.eval.exact_sums import RANGE, ExactSums
from rebm.eval.features.fid import FEATURES_ENV, MomentSums, feature_statistics
from rebm.standin.writers import write_fake_cifar10
from tests.helpers import REPO, base_env, run_command, torchrun_cmd
from tests.processes import spawn_ranks
from tests.standins import STANDIN, fit_head, standin_features, write_standin_statistics

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.numbers]


def _values(n: int, seed: int = 0) -> torch.Tensor:
    """(n, 9) float64 of both signs, each column of another magnitude (1e-12 to 1e9)."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-12, 9, 9, dtype=torch.float64)
    return torch.randn(n, 9, generator=generator, dtype=torch.float64) * scales


def _total(sums: ExactSums) -> torch.Tensor:
    return sums.total_all_ranks(Runtime())


def test_totals_do_not_depend_on_the_order_of_the_adds():
    values = _values(600)
    forward, backward, shuffled = ExactSums(), ExactSums(), ExactSums()
    for row in values:
        forward.add(row)
    for row in values.flip(0):
        backward.add(row)
    for row in values[torch.randperm(600, generator=torch.Generator().manual_seed(1))]:
        shuffled.add(row)
    total = _total(forward)
    assert torch.equal(total, _total(backward)) and torch.equal(total, _total(shuffled))
    assert not torch.equal(values.sum(0), values.flip(0).sum(0))  # float64 sums would differ
    exact = torch.tensor([math.fsum(column) for column in values.T.tolist()], dtype=torch.float64)
    # the values of 2^-32 and more are exact, so their totals are the float64 of the exact sum
    # (within the read's unit in the last place); the 1e-12 column is rounded to 2^-85 a value
    big = values.abs().amin(0) >= 2.0**-32
    assert torch.allclose(total[big], exact[big], rtol=2 * 2.0**-52, atol=0)
    assert torch.allclose(total, exact, rtol=1e-12, atol=600 * 2.0**-85)


def test_indexed_adds_are_rows_of_the_sums():
    values, index = _values(50, seed=2), torch.arange(50) % 4
    sums = ExactSums(rows=5)
    for part, rows in zip(values.split(8), index.split(8), strict=True):
        sums.add(part, rows)
    total = _total(sums)
    assert total.shape == (5, 9) and torch.equal(total[4], torch.zeros(9, dtype=torch.float64))
    for row in range(4):
        expect = torch.tensor([math.fsum(c) for c in values[index == row].T.tolist()],
                              dtype=torch.float64)
        assert torch.allclose(total[row], expect, rtol=1e-12, atol=1e-20)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), RANGE])
def test_out_of_range_or_not_finite_is_an_error(bad):
    sums = ExactSums()
    sums.add(torch.tensor([1.0, bad], dtype=torch.float64))
    with pytest.raises(ValueError, match="beyond the exact sums' range"):
        _total(sums)
    assert ExactSums().total_all_ranks(Runtime()) is None  # nothing added anywhere


def test_fid_moments_do_not_depend_on_the_order_of_the_chunks():
    features = torch.rand(203, 24, generator=torch.Generator().manual_seed(3),
                          dtype=torch.float64) * 3
    chunks = list(features.split(16))
    forward, backward = MomentSums(), MomentSums()
    for chunk in chunks:
        forward.add(chunk)
    for chunk in reversed(chunks):
        backward.add(chunk)
    mu, sigma = forward.statistics_all_ranks(Runtime())
    mu2, sigma2 = backward.statistics_all_ranks(Runtime())
    assert np.array_equal(mu, mu2) and np.array_equal(sigma, sigma2)
    mu_np, sigma_np = feature_statistics(features.numpy())
    assert np.allclose(mu, mu_np, rtol=1e-13) and np.allclose(sigma, sigma_np, rtol=1e-10,
                                                              atol=1e-13)


# --------------------------------------------------------------------------------------------
# Real processes
# --------------------------------------------------------------------------------------------
def _sums_worker(out_dir: str) -> None:
    runtime = rd.setup_distributed()
    values = _values(40, seed=5)
    sums, moments = ExactSums(), MomentSums()
    # two chunks of 20 rows, chunk k on rank k % W: on 3 ranks, rank 2 adds nothing
    for start in range(runtime.rank * 20, 40, runtime.world_size * 20):
        for row in values[start:start + 20]:
            sums.add(row)
        moments.add(values[start:start + 20, :4].abs())
    mu, sigma = moments.statistics_all_ranks(runtime)
    torch.save({"total": sums.total_all_ranks(runtime), "mu": mu, "sigma": sigma},
               os.path.join(out_dir, f"w{runtime.world_size}_rank{runtime.rank}.pt"))
    rd.teardown(runtime)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_same_totals_on_1_2_3_processes(tmp_path):
    for world in (1, 2, 3):
        spawn_ranks(_sums_worker, world, str(tmp_path))
    single = torch.load(tmp_path / "w1_rank0.pt", weights_only=False)
    for world in (2, 3):
        for rank in range(world):
            other = torch.load(tmp_path / f"w{world}_rank{rank}.pt", weights_only=False)
            assert torch.equal(other["total"], single["total"]), (world, rank)
            assert np.array_equal(other["mu"], single["mu"]), (world, rank)
            assert np.array_equal(other["sigma"], single["sigma"]), (world, rank)


# --------------------------------------------------------------------------------------------
# The real entry point: 500 samples on 1, 2 and 3 processes
# --------------------------------------------------------------------------------------------
# Each sample is resized to 299 px for the Inception Score, the bulk of a run's time, so the count
# is small: 50 samples in each of the Inception Score's 10 splits, which straddle the ranks.
N_SAMPLES = 500
BATCH = 24  # 20 full chunks and a last one of 20: 7, 7 and 7 chunks on 3 ranks, the last partial


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny CIFAR-10 and a model that fits its test images; 500 uniform-noise images (what
    the samples start from, so the two sets overlap) as the reference batch of precision/recall
    and as the FID statistics (stand-in features)."""
    from rebm.config import load_config
    from rebm.data.pipeline import indist_source
    from rebm.models import build_model

    root = tmp_path_factory.mktemp("exact")
    write_fake_cifar10(str(root), n_train=40, n_test=20)
    cfg = load_config(None, _overrides(root))
    test = indist_source(cfg.data, "test")
    x = test.images(np.arange(20)).float() / 255.0
    torch.manual_seed(0)
    model = build_model("WideResNet10x1", 10).eval()
    fit_head(model, x, test.labels(np.arange(20)))
    torch.save(model.state_dict(), root / "model.pth")
    noise = np.random.default_rng(0).integers(0, 256, (N_SAMPLES, 16, 16, 3), dtype=np.uint8)
    np.savez(root / "reference.npz", arr_0=noise)
    features = standin_features(torch.from_numpy(noise).permute(0, 3, 1, 2).double() / 255)
    write_standin_statistics(root / "stats.npz", *feature_statistics(features.numpy()))
    (root / "config.yaml").write_text("rand_seed: 3\n")
    return root


def _overrides(root) -> list:
    return ["data.indist_dataset=cifar10", "data.num_workers=0", "data.image_size=16",
            "data.outdist_dataset=noise", "model.model_type=WideResNet10x1",
            f"data.indist_ds_dir={root}", f"model.ckpt_path={root}/model.pth",
            "image_log.num_steps=2", "image_log.step_size=0.5",
            f"image_log.num_samples={N_SAMPLES}", "image_log.log_fid=true",
            f"image_log.data_dir={root}/stats.npz", f"eval.pr_reference={root}/reference.npz",
            "rand_seed=3", "robust_eval=false",
            "eval.num_images=8", f"per_device_eval_batch_size={BATCH}"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_fid_is_and_precision_recall_identical_on_1_2_3_processes(data, tmp_path):
    """The numbers of one process, bit for bit, on 2 and 3 (torchrun, one thread each)."""
    results = {}
    for world in (1, 2, 3):
        args = [str(data / "config.yaml"), *_overrides(data), f"run_dir={tmp_path / str(world)}",
                "--samples", "--no-ece", "--metrics", "inception_score,precision_recall"]
        cmd = ([sys.executable, "-m", "rebm.eval.evaluate", *args] if world == 1
               else torchrun_cmd("rebm.eval.evaluate", args, world))
        env = base_env(1, {FEATURES_ENV: STANDIN, "PYTHONPATH": str(REPO)})
        output = run_command(cmd, timeout=360, env=env).assert_ok().output
        results[world] = json.loads(output.strip().splitlines()[-1])
    keys = ("fid_standin", "inception_score_standin", "inception_score_standin_std",
            "precision_standin", "recall_standin")
    single = results[1]
    assert single["settings"]["fid"]["num_samples"] == N_SAMPLES
    assert 0 < single["fid_standin"] and 1 < single["inception_score_standin"]
    assert 0 < single["precision_standin"] < 1 and 0 < single["recall_standin"] < 1
    assert single["n_real"] == N_SAMPLES
    for world in (2, 3):
        assert {k: results[world][k] for k in keys} == {k: single[k] for k in keys}, world
