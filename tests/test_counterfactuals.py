"""Counterfactual explanations (rebm/eval/counterfactuals.py): targets, the confidence reached,
per-class FID against per-class statistics written by the real entry point, the grid files, and
the same numbers on 1 and 2 real processes."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from rebm import distributed as rd
from rebm.config import load_config
from rebm.eval.counterfactuals import class_image_set, target_classes
from tests.fake_data import write_fake_cifar10
from tests.helpers import REPO, base_env, run_command
from tests.processes import spawn_ranks

STANDIN = "tests.standins:standin_features"
OVERRIDES = ["data.indist_dataset=cifar10", "data.image_size=16", "data.num_workers=0",
             "model.model_type=WideResNet10x1", "rand_seed=1"]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_targets_are_every_other_class_or_the_next_ones():
    labels = torch.tensor([0, 3, 9])
    everything = target_classes(labels, 10)
    assert everything.shape == (3, 9)
    for row, y in zip(everything.tolist(), labels.tolist(), strict=True):
        assert sorted(row + [y]) == list(range(10))
    assert target_classes(labels, 10, 2).tolist() == [[1, 2], [4, 5], [0, 1]]
    assert target_classes(labels, 10, 50).shape == (3, 9)


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


def test_class_statistics_are_those_of_the_class_images(setup):
    from tests.standins import standin_features

    root, stats = setup
    cfg = load_config(None, [*OVERRIDES, f"data.indist_ds_dir={root}"])
    for label in (0, 7):
        images = class_image_set(cfg, label)
        assert (images.labels(np.arange(len(images))) == label).all()
        feats = standin_features(images.images(np.arange(len(images)))).numpy()
        with np.load(stats.format(label=label)) as ref:
            np.testing.assert_allclose(ref["mu"], feats.mean(0), rtol=1e-6)
            np.testing.assert_allclose(ref["sigma"], np.cov(feats, rowvar=False), rtol=1e-5,
                                       atol=1e-10)


def _cf_worker(root: str, stats: str, out: str) -> None:
    from rebm.data.ood_sets import indist_test_set
    from rebm.eval.evaluation import EvalSpec, evaluate_model, load_eval_model

    runtime = rd.setup_distributed()
    base = [*OVERRIDES, f"data.indist_ds_dir={root}", f"model.ckpt_path={root}/model.pth",
            "image_log.num_steps=5", "image_log.step_size=0.5"]
    cfg = load_config(None, [*base, "eval.counterfactual_num_images=7",
                             f"eval.counterfactual_fid_stats={stats}"])
    model = load_eval_model(cfg, runtime)
    folder = os.path.join(out, f"run{runtime.world_size}")
    result = evaluate_model(model, cfg, runtime, EvalSpec(("counterfactuals",), 20, folder))
    few = load_config(None, [*base, "eval.counterfactual_num_images=3",
                             "eval.counterfactual_num_targets=2", "eval.counterfactual_steps=2"])
    result["few"] = evaluate_model(model, few, runtime,
                                   EvalSpec(("counterfactuals",), 20, folder + "_few"))
    with torch.no_grad():  # the clean target-class confidence, for comparison
        x = indist_test_set(cfg).images(np.arange(7))
        y = torch.tensor([int(v) for v in indist_test_set(cfg).labels(np.arange(7))])
        probs = model(x).double().softmax(1)
        result["clean"] = float(probs.gather(1, target_classes(y, 10)).mean())
    torch.save(result, os.path.join(out, f"w{runtime.world_size}_r{runtime.rank}.pt"))
    rd.teardown(runtime)


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
    for rank in (0, 1):
        assert torch.load(tmp_path / f"w2_r{rank}.pt") == single  # bit for bit
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
