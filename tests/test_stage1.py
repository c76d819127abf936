"""Stage 1 (InNOutRobustnessMean0_cifar100/) then stage 2, in real processes on CPU (gloo):
torchrun and the --nproc spawn launcher give identical weights, a 2-process DAT run starts from the
stage-1 checkpoint, and the robustness test reads it."""

import json
import sys

import pytest
import torch

from tests.helpers import BIN, REPO, base_env, run_command, run_train

SCRIPT_DIR = REPO / "InNOutRobustnessMean0_cifar100"
TRAIN_AT = str(SCRIPT_DIR / "train_at.py")
ROBUSTNESS_TEST = str(SCRIPT_DIR / "cifar10_robustness_test.py")
CONFIG = "experiments/quickstart/digits_stage1.yaml"
TINY = ["batch_size=32", "max_steps=3", "indist_attack_clf.max_steps=1",
        "n_imgs_per_metrics_log=64", "n_imgs_per_evaluation_log=96"]


def last_json(output: str) -> dict:
    return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])


@pytest.fixture(scope="module")
def stage1_torchrun(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("stage1") / "torchrun"
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", TRAIN_AT, CONFIG, *TINY,
           f"run_dir={run_dir}"]
    run_command(cmd, timeout=120, env=base_env(1)).assert_ok()
    return run_dir


@pytest.mark.timeout(240)
def test_torchrun_and_spawn_give_identical_weights(stage1_torchrun, tmp_path):
    spawn_dir = tmp_path / "spawn"
    cmd = [sys.executable, TRAIN_AT, CONFIG, "--nproc", "2", *TINY, f"run_dir={spawn_dir}"]
    run_command(cmd, timeout=120, env=base_env(1)).assert_ok()
    a = torch.load(stage1_torchrun / "model_final.pth", weights_only=True)
    b = torch.load(spawn_dir / "model_final.pth", weights_only=True)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "torchrun and spawn runs differ"
    # live BatchNorm: the (EMA of the) running statistics moved away from their initial 0 / 1
    assert a["block1.layer.0.bn1.running_mean"].abs().max() > 0
    assert (a["block1.layer.0.bn1.running_var"] - 1).abs().max() > 0
    records = [json.loads(line) for line in open(stage1_torchrun / "metrics.jsonl")]
    assert [r["step"] for r in records if "train_clf_loss" in r] == [2, 3]
    assert any("robust_test_acc" in r for r in records)


@pytest.mark.timeout(180)
def test_dat_starts_from_stage1_checkpoint(stage1_torchrun, tmp_path):
    ckpt = stage1_torchrun / "model_final.pth"
    result = run_train(["experiments/quickstart/digits.yaml", f"model.ckpt_path={ckpt}",
                        "max_steps=2", "batch_size=32", "attack.max_steps=1",
                        "indist_attack_clf.max_steps=1", "n_imgs_per_evaluation_log=null"],
                       nproc=2, timeout=150, run_dir=tmp_path / "dat").assert_ok()
    assert f"loaded checkpoint '{ckpt}'" in result.output
    assert (tmp_path / "dat" / "model_final.pth").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag, key", [(None, "test_acc"), ("--calibration_only", "ece")])
def test_robustness_test_prints_json(stage1_torchrun, flag, key):
    cmd = [sys.executable, ROBUSTNESS_TEST, CONFIG,
           f"model.ckpt_path={stage1_torchrun / 'model_final.pth'}", "robust_eval_steps=1",
           *([flag] if flag else [])]
    result = run_command(cmd, timeout=100, env=base_env(2)).assert_ok()
    metrics = last_json(result.output)
    assert 0.0 <= metrics[key] <= 1.0
    if flag is None:
        assert metrics["n_test"] == 359 and "robust_test_acc" in metrics
    else:
        assert "test_acc" not in metrics
