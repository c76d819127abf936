"""Evaluation: sharded metrics equal the single-process ones, and the metric math is right.

The multi-rank tests run the real loader (`build_eval_data`) on a tiny CIFAR-10 written in the
real on-disk format with an odd test set (101 images), in real processes (gloo).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

from rebm import distributed as rd
from rebm.config import load_config, plan_batches
from rebm.eval.features import fid
from rebm.eval.metrics.calibration import calibration_bins, ece_from_bins
from rebm.eval.sampling.generation import SeedImageError, SeedImages
from rebm.standin.writers import write_fake_cifar10
from tests.helpers import REPO, base_env, run_command
from tests.processes import spawn_ranks
from tests.standins import fit_head

pytestmark = pytest.mark.numbers

N_TEST = 101
EVAL_OVERRIDES = [
    "data.indist_dataset=cifar10",
    "data.num_workers=0",
    "data.outdist_dataset=noise",
    "data.image_size=16",
    "model.model_type=WideResNet10x1",
    "indist_attack_clf.max_steps=2",
    "indist_attack_clf.step_size=0.025",
    "indist_attack_clf.eps=0.05",
    "indist_attack_clf.random_start=true",
    "image_log.num_steps=3",
    "image_log.step_size=0.5",
    "image_log.num_samples=13",
    "rand_seed=3",
]


def _eval_cfg(root: str, *extra: str):
    return load_config(None, [*EVAL_OVERRIDES, f"data.indist_ds_dir={root}", *extra])


@pytest.fixture(scope="module")
def fake_cifar(tmp_path_factory):
    """(data root, checkpoint path) of a tiny CIFAR-10 and a model that fits part of its test set."""
    from rebm.data.pipeline import indist_source
    from rebm.models import build_model

    root = tmp_path_factory.mktemp("cifar")
    write_fake_cifar10(str(root), n_train=10, n_test=N_TEST)
    test = indist_source(_eval_cfg(str(root)).data, "test")
    x = test.images(np.arange(N_TEST)).float() / 255.0
    y = test.labels(np.arange(N_TEST))
    torch.manual_seed(0)
    model = build_model("WideResNet10x1", 10).eval()
    fit_head(model, x[::2], y[::2])  # half the images: accuracy well between 0 and 1
    ckpt = root / "model.pth"
    torch.save(model.state_dict(), ckpt)
    return str(root), str(ckpt)


def _metrics_worker(root: str, ckpt: str, out_dir: str) -> None:
    from rebm.eval.evaluator import Evaluator, load_eval_model

    runtime = rd.setup_distributed()
    cfg = _eval_cfg(root, f"model.ckpt_path={ckpt}")
    model = load_eval_model(cfg.model, cfg.data, cfg.ema.use_ema, runtime)
    run_dir = os.path.join(out_dir, f"w{runtime.world_size}")
    evaluator = Evaluator(cfg.evaluation, runtime, ("accuracy", "robust_accuracy", "ece", "ood",
                                         "samples_npz"), batch_size=16, run_dir=run_dir)
    eval_results = evaluator.evaluate_all_ranks(model)
    result = dict(eval_results.values)
    with np.load(eval_results.files["samples_npz"]) as npz:  # every sample, index order
        result["pixels"] = torch.from_numpy(npz["arr_0"])
    torch.save(result, os.path.join(out_dir, f"w{runtime.world_size}_rank{runtime.rank}.pt"))
    rd.teardown(runtime)


@pytest.fixture(scope="module")
def sharded_results(fake_cifar, tmp_path_factory):
    """The worker's results on 1, 2 and 3 ranks: {world_size: [result of each rank]}."""
    out = tmp_path_factory.mktemp("results")
    for world in (1, 2, 3):
        spawn_ranks(_metrics_worker, world, *fake_cifar, str(out))
    return {w: [torch.load(out / f"w{w}_rank{r}.pt") for r in range(w)] for w in (1, 2, 3)}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_accuracy_identical_on_1_2_3_ranks(sharded_results):
    single = sharded_results[1][0]
    assert single["n_test"] == N_TEST
    # The fixture model is neither trivial nor unattackable, so these numbers mean something.
    assert 0.2 < single["test_acc"] < 1.0
    assert single["robust_test_acc"] < single["test_acc"]
    for world in (2, 3):
        for rank_result in sharded_results[world]:
            # ECE's bins are exact sums (rebm/eval/exact_sums.py): the same bits
            for key in ("test_acc", "robust_test_acc", "n_test", "n_ood", "ece"):
                assert rank_result[key] == single[key], (world, key)
            assert rank_result["ood_auroc"] == pytest.approx(single["ood_auroc"], abs=1e-12)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_samples_identical_on_1_2_3_ranks(sharded_results):
    from rebm.eval.metric import to_pixels

    single = sharded_results[1][0]
    assert single["pixels"].shape == (13, 16, 16, 3)
    for world in (2, 3):
        for rank_result in sharded_results[world]:
            # Same seeds, labels, steps and batch neighbours per index (chunk k on rank k % W)
            assert torch.equal(rank_result["pixels"], single["pixels"]), world
    # the attack moved the seeds
    seeds = SeedImages("noise", 16, rand_seed=3)(torch.arange(13))
    assert not torch.equal(single["pixels"], to_pixels(seeds).permute(0, 2, 3, 1))


@pytest.mark.parametrize("overrides, expected", [
    ((), {1: 64, 2: 64, 4: 48, 8: 24}),  # batch_size 64: min(64, 3 x 64/W)
    (("per_device_batch_size=8",), {1: 24, 2: 24, 4: 24, 8: 24}),
    (("per_device_eval_batch_size=100",), {1: 100, 2: 100, 4: 100, 8: 100}),
])
def test_eval_batch_does_not_shrink_with_world_size_until_memory_says_so(overrides, expected):
    from rebm.config import eval_batch_size

    cfg = load_config(None, ["batch_size=64", *overrides])
    for world_size, want in expected.items():
        assert eval_batch_size(cfg.schedule, cfg.eval, world_size) == want, world_size
        # the training batch plan carries the same number (one source)
        assert plan_batches(cfg.schedule, cfg.eval, world_size).eval_batch_size == want, world_size


def test_stage1_plan_evaluates_in_micro_batches():
    cfg = load_config(None, ["batch_size=64"])
    assert plan_batches(cfg.schedule, cfg.eval, 2, loss_streams=1).eval_batch_size == 32


def test_ece_hand_example():
    probs = torch.tensor([
        [0.93, 0.07],  # label 0: correct, conf .93  -> bin (0.90, 0.95]
        [0.91, 0.09],  # label 1: wrong,   conf .91  -> same bin
        [0.36, 0.64],  # label 1: correct, conf .64  -> bin (0.60, 0.65]
        [0.34, 0.66],  # label 0: wrong,   conf .66  -> bin (0.65, 0.70] (same bin with 10 bins)
        [0.22, 0.78],  # label 0: wrong,   conf .78  -> bin (0.75, 0.80]
    ])
    labels = torch.tensor([0, 1, 1, 0, 0])
    # (2|0.5 - 0.92| + |1 - .64| + |0 - .66| + |0 - .78|) / 5
    assert ece_from_bins(calibration_bins(probs, labels)) == pytest.approx(0.528)
    assert ece_from_bins(calibration_bins(probs, labels, n_bins=10)) == pytest.approx(0.384)
    # bin sums add up over shards, so a sharded ECE is exact
    halves = calibration_bins(probs[:2], labels[:2]) + calibration_bins(probs[2:], labels[2:])
    assert ece_from_bins(halves) == pytest.approx(0.528)


def test_frechet_distance_closed_form():
    rng = np.random.default_rng(0)
    mu1, mu2 = rng.normal(size=6), rng.normal(size=6)
    s1, s2 = rng.uniform(0.1, 3.0, size=6), rng.uniform(0.1, 3.0, size=6)
    expected = np.sum((mu1 - mu2) ** 2) + np.sum(s1 + s2 - 2 * np.sqrt(s1 * s2))
    assert fid.frechet_distance(mu1, np.diag(s1), mu2, np.diag(s2)) == pytest.approx(expected)
    a = rng.normal(size=(6, 6))
    sigma = a @ a.T
    assert fid.frechet_distance(mu1, sigma, mu1, sigma) == pytest.approx(0.0, abs=1e-6)
    # rank-deficient covariances (fewer samples than dimensions) still give a finite number
    feats = rng.normal(size=(3, 6))
    mu, cov = fid.feature_statistics(feats)
    assert np.isfinite(fid.frechet_distance(mu, cov, mu2, np.diag(s2)))


def _fid_evaluator(tmp_path, *overrides):
    from rebm.distributed import Runtime
    from rebm.eval.evaluator import Evaluator

    cfg = _eval_cfg(str(tmp_path), "image_log.log_fid=true", *overrides)
    return Evaluator(cfg.evaluation, Runtime(), ("fid",))


def test_fid_missing_reference_stops_the_evaluation_at_start(tmp_path, monkeypatch):
    from rebm.eval.metric import EvalError

    monkeypatch.setenv(fid.FEATURES_ENV, "rebm.eval.standin:features")
    missing = tmp_path / "nope" / "cifar10_stats.npz"
    evaluator = _fid_evaluator(tmp_path, f"image_log.data_dir={missing}")
    assert len(evaluator.problems()) == 1 and str(missing) in evaluator.problems()[0]
    with pytest.raises(EvalError, match="does not exist") as err:
        evaluator.start_all_ranks()
    assert str(missing) in str(err.value) and "\n" not in str(err.value)


def test_fid_without_inception_weights_stops_the_evaluation_with_one_line(tmp_path,
                                                                        monkeypatch):
    from rebm.eval.metric import EvalError

    monkeypatch.delenv(fid.FEATURES_ENV, raising=False)
    ref = tmp_path / "stats.npz"
    np.savez(ref, mu=np.zeros(2048), sigma=np.eye(2048))
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "empty_hub"))
    evaluator = _fid_evaluator(tmp_path, f"image_log.data_dir={ref}")
    (problem,) = evaluator.problems()
    assert "Inception" in problem and fid.STANDIN_SPEC in problem
    with pytest.raises(EvalError, match="Inception"):
        evaluator.start_all_ranks()
    assert not evaluator.started


def test_seed_images_errors_name_the_path(tmp_path):
    empty = tmp_path / "empty_seeds"
    empty.mkdir()
    with pytest.raises(SeedImageError, match=str(empty)):
        SeedImages(str(empty), 16, rand_seed=0)
    missing = tmp_path / "missing.pt"
    with pytest.raises(SeedImageError, match=str(missing)):
        SeedImages(str(missing), 16, rand_seed=0)


def test_seed_images_from_tensor_file_folder_and_noise(tmp_path):
    from torchvision.utils import save_image

    path = tmp_path / "seeds.pt"
    stored = torch.rand(5, 3, 16, 16)
    torch.save(stored, path)
    seeds = SeedImages(str(path), 16, rand_seed=0)
    assert torch.equal(seeds(torch.tensor([1, 6])), stored[[1, 1]])  # cycled
    assert SeedImages(str(path), 8, rand_seed=0)(torch.tensor([0])).shape == (1, 3, 8, 8)
    folder = tmp_path / "seed_folder"
    folder.mkdir()
    for i in range(2):
        save_image(stored[i], folder / f"{i}.png")
    from_folder = SeedImages(str(folder), 16, rand_seed=0)(torch.tensor([0, 1, 2]))
    assert from_folder.shape == (3, 3, 16, 16)
    torch.testing.assert_close(from_folder[2], from_folder[0])
    torch.testing.assert_close(from_folder[1], stored[1], atol=1 / 255, rtol=0)  # 8-bit PNG
    noise = SeedImages("noise", 16, rand_seed=0)
    # noise of an index does not depend on the batch it is drawn in
    assert torch.equal(noise(torch.arange(6))[4:], noise(torch.tensor([4, 5])))
    assert not torch.equal(noise(torch.tensor([0])), SeedImages("noise", 16, 1)(torch.tensor([0])))


# --------------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_evaluate_entry_point_prints_json(tmp_path):
    from rebm.data.pipeline import load_indist
    from rebm.models import build_model, dataset_stats

    config = str(REPO / "experiments" / "quickstart" / "digits.yaml")
    cfg = load_config(config)
    mean, std = dataset_stats("digits")
    model = build_model(cfg.model.model_type, 10, mean=mean, std=std)
    ckpt = tmp_path / "model_final.pth"
    torch.save(model.state_dict(), ckpt)
    cmd = [sys.executable, "-m", "rebm.eval.evaluate", config, f"model.ckpt_path={ckpt}",
           "indist_attack_clf.max_steps=2", "robust_eval_steps=2", "image_log.num_steps=2",
           "image_log.num_samples=10",
           "--samples"]
    result = run_command(cmd, timeout=150, env=base_env()).assert_ok()
    last = result.output.strip().splitlines()[-1]
    metrics = json.loads(last)
    assert metrics["n_test"] == len(load_indist(cfg.data, "test"))
    for key in ("test_acc", "robust_test_acc", "ece"):
        assert 0.0 <= metrics[key] <= 1.0
    assert json.loads((tmp_path / "eval.json").read_text()) == metrics
    assert (tmp_path / "samples" / "gen_samples.png").is_file()
    assert (tmp_path / "samples" / "seed_samples.png").is_file()
    assert "fid" not in metrics  # log_fid is off in this config (FID: tests/test_fid.py)
    assert f"metrics written to {tmp_path / 'eval.json'}" in result.output


def test_evaluate_missing_checkpoint_is_one_line_error(tmp_path):
    from rebm.eval.commands.evaluate import main

    config = str(REPO / "experiments" / "quickstart" / "digits.yaml")
    with pytest.raises(SystemExit) as exit_info:
        main([config, f"model.ckpt_path={tmp_path / 'absent.pth'}"])
    assert exit_info.value.code == 2
