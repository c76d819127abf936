"""Counterfactual explanations (rebm/eval/metrics/counterfactuals/ and the per-class statistics
command rebm/eval/commands/class_stats.py), both protocols: the original's
(training images, one seeded random target class each, FID per target class, checked against a
direct computation) and the grid (test images toward every other class); per-class statistics
written by the real entry point; the same numbers on 1 and 2 real processes."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from rebm import distributed as rd
from rebm.config import load_config
from rebm.eval.metrics.counterfactuals import Counterfactuals, counterfactual_settings
from rebm.eval.metrics.counterfactuals.attack import CounterfactualSettings
from rebm.eval.metrics.counterfactuals.grid import target_classes
from rebm.eval.metrics.counterfactuals.original import class_chunks, random_targets, train_image_set
from rebm.eval.metrics.counterfactuals.stats import class_image_set
from rebm.standin.writers import write_fake_cifar10
from tests.helpers import REPO, base_env, run_command
from tests.processes import spawn_ranks

STANDIN = "rebm.eval.standin:features"
OVERRIDES = ["data.indist_dataset=cifar10", "data.image_size=16", "data.num_workers=0",
             "model.model_type=WideResNet10x1", "rand_seed=1"]


# one torch thread in this process: the pytest workers already fill the cores
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.numbers]


def test_targets_are_every_other_class_or_the_next_ones():
    labels = torch.tensor([0, 3, 9])
    everything = target_classes(labels, 10)
    assert everything.shape == (3, 9)
    for row, y in zip(everything.tolist(), labels.tolist(), strict=True):
        assert sorted(row + [y]) == list(range(10))
    assert target_classes(labels, 10, 2).tolist() == [[1, 2], [4, 5], [0, 1]]
    assert target_classes(labels, 10, 50).shape == (3, 9)


def test_settings_defaults_are_the_configs():
    """A CounterfactualSettings() made in code computes what an empty config does."""
    cfg = load_config(None, [])
    assert CounterfactualSettings().protocol == cfg.eval.counterfactual_protocol == "original"
    settings = counterfactual_settings(cfg.evaluation)
    assert CounterfactualSettings().num_images == settings.num_images is None
    assert CounterfactualSettings().num_targets == settings.num_targets


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from rebm.models import build_model

    root = tmp_path_factory.mktemp("cf")
    write_fake_cifar10(str(root), n_train=60, n_test=9)
    torch.manual_seed(0)
    torch.save(build_model("WideResNet10x1", 10).state_dict(), root / "model.pth")
    config = root / "config.yaml"
    config.write_text("rand_seed: 1\n")
    stats = str(root / "stats" / "class{label}.npz")
    # the real entry point: one .npz per class of the training split
    cmd = [sys.executable, "-m", "rebm.eval.counterfactuals", str(config), *OVERRIDES,
           f"data.indist_ds_dir={root}", "--class-stats", stats, "--batch-size", "4"]
    env = base_env(1, {"REBM_FID_FEATURES": STANDIN, "PYTHONPATH": str(REPO)})
    run_command(cmd, timeout=240, env=env).assert_ok()
    return root, stats


@pytest.mark.slow
def test_class_statistics_are_those_of_the_class_images(setup):
    from tests.standins import standin_features

    root, stats = setup
    cfg = load_config(None, [*OVERRIDES, f"data.indist_ds_dir={root}"])
    for label in (0, 7):
        images = class_image_set(cfg.evaluation, label)
        assert (images.labels(np.arange(len(images))) == label).all()
        feats = standin_features(images.images(np.arange(len(images)))).numpy()
        with np.load(stats.format(label=label)) as ref:
            np.testing.assert_allclose(ref["mu"], feats.mean(0), rtol=1e-6)
            np.testing.assert_allclose(ref["sigma"], np.cov(feats, rowvar=False), rtol=1e-5,
                                       atol=1e-10)


def _cf_worker(root: str, stats: str, out: str) -> None:
    from rebm.data.ood_datasets import indist_test_set
    from rebm.distributed.signals import PreemptionFlag
    from rebm.eval.evaluator import Evaluator, load_eval_model

    def counterfactuals_of(model, cfg, runtime, batch_size, run_dir):
        evaluator = Evaluator(cfg.evaluation, runtime, ("counterfactuals",), batch_size=batch_size,
                              run_dir=run_dir)
        return evaluator.evaluate_all_ranks(model).values

    runtime = rd.setup_distributed()
    base = [*OVERRIDES, f"data.indist_ds_dir={root}", f"model.ckpt_path={root}/model.pth",
            "image_log.num_steps=5", "image_log.step_size=0.5", "eval.counterfactual_protocol=grid"]
    cfg = load_config(None, [*base, "eval.counterfactual_num_images=7",
                             f"eval.counterfactual_fid_stats={stats}"])
    model = load_eval_model(cfg.model, cfg.data, cfg.ema.use_ema, runtime)
    folder = os.path.join(out, f"run{runtime.world_size}")
    result = counterfactuals_of(model, cfg, runtime, 20, folder)
    original = load_config(None, [*base, "eval.counterfactual_protocol=original",
                                  f"eval.counterfactual_fid_stats={stats}"])
    # as inside training: every loop polls the preemption flag through a collective, which
    # must line up with the per-class FID collectives on ranks with different chunk counts
    polled = dataclasses.replace(runtime, preemption=PreemptionFlag().install())
    result["original"] = counterfactuals_of(model, original, polled, 4,
                                        os.path.join(out, f"original{runtime.world_size}"))
    few = load_config(None, [*base, "eval.counterfactual_num_images=3",
                             "eval.counterfactual_num_targets=2", "eval.counterfactual_steps=2"])
    result["few"] = counterfactuals_of(model, few, runtime, 20, folder + "_few")
    with torch.no_grad():  # the clean target-class confidence, for comparison
        x = indist_test_set(cfg.data).images(np.arange(7))
        y = torch.tensor([int(v) for v in indist_test_set(cfg.data).labels(np.arange(7))])
        probs = model(x).double().softmax(1)
        result["clean"] = float(probs.gather(1, target_classes(y, 10)).mean())
    torch.save(result, os.path.join(out, f"w{runtime.world_size}_r{runtime.rank}.pt"))
    rd.teardown(runtime)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_counterfactuals_identical_on_1_and_2_processes_with_grids_and_class_fid(
        setup, tmp_path, monkeypatch):
    root, stats = setup
    # one intra-op thread in every process: the thread count changes float summation order,
    # the world size must not change anything else
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("REBM_FID_FEATURES", STANDIN)  # this process (1 rank) and spawned ranks
    for world in (1, 2):
        spawn_ranks(_cf_worker, world, str(root), stats, str(tmp_path))
    single = torch.load(tmp_path / "w1_r0.pt")
    original = single.pop("original")
    for rank in (0, 1):
        other = torch.load(tmp_path / f"w2_r{rank}.pt")
        other_original = other.pop("original")
        assert other == single  # bit for bit
        _assert_same_original(other_original, original)
    _check_original(original, tmp_path)
    assert single["n_counterfactuals"] == 7 * 9
    assert single["counterfactual_confidence"] > single["clean"]  # the ascent moved them
    assert 0.0 <= single["counterfactual_success"] <= 1.0
    assert single["counterfactual_fid_standin"] > 0  # stand-in features: never stored as FID
    assert "counterfactual_fid_standin" not in single["few"]  # no statistics given
    assert single["few"]["n_counterfactuals"] == 3 * 2
    for world in (1, 2):
        grids = tmp_path / f"run{world}" / "counterfactuals"
        assert sorted(os.listdir(grids)) == sorted([f"{p}.png" for p in range(7)]
                                                   + ["per_class.json"])
        # 10 tiles of 16 px with 1 px padding: one tile per class
        assert Image.open(grids / "0.png").size == (10 * 17 + 1, 17 + 1)
        few = tmp_path / f"run{world}_few" / "counterfactuals"
        assert Image.open(few / "0.png").size == (3 * 17 + 1, 18)
        per_class = json.loads((grids / "per_class.json").read_text())
        assert set(per_class) == {"confidence", "success", "fid"}
        assert np.mean(list(per_class["fid"].values())) == pytest.approx(
            single["counterfactual_fid_standin"])
    grid = os.path.join("counterfactuals", "3.png")
    assert (tmp_path / "run1" / grid).read_bytes() == (tmp_path / "run2" / grid).read_bytes()


def _assert_same_original(got: dict, expected: dict) -> None:
    """Bit for bit but the FIDs, whose feature sums add up in another order over 2 ranks."""
    assert set(got) == set(expected)
    for key, value in expected.items():
        if key.startswith("counterfactual_fid"):
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key
        else:
            assert got[key] == value, key


def _check_original(result: dict, tmp_path) -> None:
    assert result["n_counterfactuals"] == 60  # every training image, once
    per_class_keys = sorted(k for k in result if k.startswith("counterfactual_fid_standin/"))
    assert per_class_keys == sorted(f"counterfactual_fid_standin/{c}" for c in range(10))
    assert result["counterfactual_fid_standin"] == pytest.approx(
        np.mean([result[k] for k in per_class_keys]))
    assert "counterfactual_fid" not in result  # stand-in features: never stored as FID
    for world in (1, 2):
        folder = tmp_path / f"original{world}" / "counterfactuals"
        per_class = json.loads((folder / "per_class.json").read_text())
        assert sum(per_class["count"].values()) == 60 and len(per_class["count"]) == 10
        assert np.mean(list(per_class["confidence"].values())) == pytest.approx(
            result["counterfactual_confidence"])
        # a row of 10 tiles per class: the first 10 counterfactuals toward it, then black
        assert Image.open(folder / "counterfactuals.png").size == (10 * 17 + 1, 10 * 17 + 1)
        assert Image.open(folder / "sources.png").size == (10 * 17 + 1, 10 * 17 + 1)
    same = ("counterfactuals.png", "sources.png")
    for name in same:
        assert ((tmp_path / "original1" / "counterfactuals" / name).read_bytes()
                == (tmp_path / "original2" / "counterfactuals" / name).read_bytes())


def test_original_targets_one_seeded_other_class_per_training_image(setup):
    root, _ = setup
    cfg = load_config(None, [*OVERRIDES, f"data.indist_ds_dir={root}"])
    sources = train_image_set(cfg.evaluation, None)
    labels = sources.labels(np.arange(len(sources)))
    targets = random_targets(labels, sources.indices, 10, seed=1)
    assert len(sources) == 60 and (targets != labels).all()
    assert set(targets.tolist()) == set(range(10))  # every class is a target
    assert targets.tolist() == random_targets(labels, sources.indices, 10, 1).tolist()
    assert targets.tolist() != random_targets(labels, sources.indices, 10, 2).tolist()
    # image i's target depends on (seed, i) alone: the same in any subset, batch or rank
    first = train_image_set(cfg.evaluation, 25)
    assert random_targets(first.labels(np.arange(25)), first.indices, 10, 1).tolist() == \
        targets[:25].tolist()
    # over many images the shift y -> target is uniform over the K - 1 other classes
    many = torch.zeros(20000, dtype=torch.int64)
    shifts = random_targets(many, np.arange(20000), 10, seed=0)
    counts = np.bincount(shifts.numpy(), minlength=10)
    assert counts[0] == 0 and abs(counts[1:] / 20000 - 1 / 9).max() < 0.01
    # CIFAR-10's 50,000 training images (5,000 per class): about 5,000 targets per class, as
    # the original's one random target per image gave (not the ~900 of a 1,000-image subset)
    labels_50k = torch.arange(50000) % 10
    targets_50k = random_targets(labels_50k, np.arange(50000), 10, seed=0)
    assert (targets_50k != labels_50k).all()
    assert abs(np.bincount(targets_50k.numpy(), minlength=10) - 5000).max() < 250
    # chunks: one target class each, class after class, every position once
    chunks = class_chunks(targets.numpy(), 10, 4)
    assert [c for c, _ in chunks] == sorted(c for c, _ in chunks)
    assert sorted(np.concatenate([p for _, p in chunks]).tolist()) == list(range(60))
    assert all((targets[torch.from_numpy(p)] == c).all() and len(p) <= 4 for c, p in chunks)


def test_original_class_fid_is_that_of_the_counterfactuals_toward_the_class(setup, monkeypatch):
    """One process, the metric's numbers against a direct computation: attack each class's
    images toward it, round to 8 bits, features, FID against the class's statistics file."""
    from rebm.attacks.pgd import pgd_attack
    from rebm.distributed import Runtime
    from rebm.eval.features.fid import feature_statistics, frechet_distance, load_reference
    from rebm.eval.metrics.counterfactuals.original import (
        evaluate_original_counterfactuals_all_ranks,
    )
    from rebm.models import build_model
    from tests.standins import standin_features

    root, stats = setup
    monkeypatch.setenv("REBM_FID_FEATURES", STANDIN)
    cfg = load_config(None, [*OVERRIDES, f"data.indist_ds_dir={root}", "image_log.num_steps=3",
                             "image_log.step_size=0.5", f"eval.counterfactual_fid_stats={stats}"])
    torch.manual_seed(0)
    model = build_model("WideResNet10x1", 10).eval()
    sources = train_image_set(cfg.evaluation, 40)
    labels = sources.labels(np.arange(40))
    targets = random_targets(labels, sources.indices, 10, cfg.schedule.rand_seed)
    result = evaluate_original_counterfactuals_all_ranks(
        model, sources, targets, counterfactual_settings(cfg.evaluation), Runtime(), num_classes=10,
        batch_size=40)  # one chunk per class: the same batches as below
    for c in range(10):
        where = np.flatnonzero(targets.numpy() == c)
        if len(where) < 2:
            assert f"counterfactual_fid/{c}" not in result
            continue
        x = sources.images(where)
        adv = pgd_attack(model, x, steps=3, step_size=0.5, norm="L2", objective="logit",
                         y=torch.full((len(where),), c))
        pixels = adv.mul(255).add(0.5).clamp(0, 255).to(torch.uint8)  # save_image's rounding
        mu, sigma = feature_statistics(standin_features(pixels.float() / 255).numpy())
        expected = frechet_distance(mu, sigma, *load_reference(stats.format(label=c)))
        assert result[f"counterfactual_fid/{c}"] == pytest.approx(expected, rel=1e-6, abs=1e-8)


def test_original_settings_and_files_name_the_protocol_and_every_statistics_file(tmp_path):
    stats = str(tmp_path / "class{label}.npz")
    cfg = load_config(None, [*OVERRIDES, f"data.indist_ds_dir={tmp_path}",
                             f"eval.counterfactual_fid_stats={stats}"])
    settings = Counterfactuals.settings(cfg.evaluation)
    assert settings["protocol"] == "original" and settings["split"] == "train"
    assert settings["num_images"] == "all" and settings["pixels"] == "round"
    files = Counterfactuals.files(cfg.evaluation)
    assert files["data.indist_ds_dir"] == str(tmp_path)
    assert [files[f"eval.counterfactual_fid_stats[{c}]"] for c in range(10)] == [
        stats.format(label=c) for c in range(10)]
    grid = load_config(None, [*OVERRIDES, "eval.counterfactual_protocol=grid"])
    assert Counterfactuals.settings(grid.evaluation)["num_images"] == 10
    assert Counterfactuals.settings(grid.evaluation)["split"] == "test"
