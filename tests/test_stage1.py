"""Stage 1 (InNOutRobustnessMean0_cifar100/) in real processes on CPU (gloo): the robustness test
reads the checkpoint, and a stopped or preempted run continues bit-identically, under torchrun and
under the --nproc spawn launcher (which so gives torchrun's weights). (A 2-process DAT run
starting from a stage-1 checkpoint is tests/test_shipped_configs.py's stage 2.)"""

import json
import os
import signal
import sys

import pytest
import torch

from tests.helpers import (
    BIN,
    REPO,
    assert_states_identical,
    base_env,
    comparable,
    finish,
    load_state,
    read_metrics,
    run_command,
    run_train,
    state_path,
    wait_for_records,
    worker_pids,
)
from tests.processes import popen

pytestmark = pytest.mark.slow

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
def test_live_batchnorm_trains_and_the_run_evaluates(stage1_torchrun):
    a = torch.load(stage1_torchrun / "model_final.pth", weights_only=True)
    # live BatchNorm: the (EMA of the) running statistics moved away from their initial 0 / 1
    assert a["block1.layer.0.bn1.running_mean"].abs().max() > 0
    assert (a["block1.layer.0.bn1.running_var"] - 1).abs().max() > 0
    records = [json.loads(line) for line in open(stage1_torchrun / "metrics.jsonl")]
    assert [r["step"] for r in records if "train_clf_loss" in r] == [2, 3]
    assert any("robust_test_acc" in r for r in records)
    # stage 1 keeps the EMA model of the best robust accuracy (In-N-Out's best_avg.pth); its
    # one evaluation is the last step's, so it is the final EMA model
    best = torch.load(stage1_torchrun / "model_bestacc.pth", weights_only=True)
    assert best.keys() == a.keys() and all(torch.equal(best[k], a[k]) for k in a)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag, key", [(None, "test_acc"), ("--calibration_only", "ece")])
def test_robustness_test_prints_json(stage1_torchrun, flag, key):
    cmd = [sys.executable, ROBUSTNESS_TEST, CONFIG,
           f"model.ckpt_path={stage1_torchrun / 'model_final.pth'}", "robust_eval_steps=1",
           *([flag] if flag else [])]
    result = run_command(cmd, timeout=100, env=base_env()).assert_ok()
    metrics = last_json(result.output)
    assert 0.0 <= metrics[key] <= 1.0
    if flag is None:
        assert metrics["n_test"] == 359 and "robust_test_acc" in metrics
    else:
        assert "test_acc" not in metrics


# Resume: constant LR, so that a run stopped at max_steps=k and continued to 2k is the same
# computation as a straight 2k-step run (a cosine schedule would depend on max_steps).
# Steps take 40-80 ms here: the 90 steps after the first metrics record (step 10) leave seconds
# for a signal to arrive mid-run.
RESUME = ["batch_size=32", "indist_attack_clf.max_steps=1", "n_imgs_per_metrics_log=320",
          "n_imgs_per_evaluation_log=null", "n_imgs_per_ckpt_save=1600", "--schedule", "constant"]
# A stop at max_steps logs (and empties) the metrics window; the SIGTERM test's stop usually
# falls inside a window, so it checks the window's restore through metrics.jsonl.
RESUME_STEPS, RESUME_STOP = 100, 45


def stage1_cmd(run_dir, steps, *extra):
    return [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", TRAIN_AT, CONFIG,
            *RESUME, f"max_steps={steps}", f"run_dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def stage1_straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("stage1_straight")
    run_command(stage1_cmd(run_dir, RESUME_STEPS), timeout=150, env=base_env(1)).assert_ok()
    return run_dir


@pytest.mark.numbers
@pytest.mark.timeout(400)
def test_stage1_stop_and_continue_is_bit_identical(stage1_straight, tmp_path):
    run_dir = tmp_path / "split"
    run_command(stage1_cmd(run_dir, RESUME_STOP), timeout=150, env=base_env(1)).assert_ok()
    result = run_command(stage1_cmd(run_dir, RESUME_STEPS), timeout=150,
                         env=base_env(1)).assert_ok()
    assert "resumed from" in result.output and f"at step {RESUME_STOP}" in result.output
    assert_states_identical(load_state(stage1_straight, RESUME_STEPS),
                            load_state(run_dir, RESUME_STEPS))
    a = torch.load(stage1_straight / "model_final.pth", weights_only=True)
    b = torch.load(run_dir / "model_final.pth", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


def spawn_cmd(run_dir, steps, *extra):
    """The same run as stage1_cmd, started by the script itself (`--nproc 2`)."""
    return [sys.executable, TRAIN_AT, CONFIG, "--nproc", "2", *RESUME, f"max_steps={steps}",
            f"run_dir={run_dir}", *extra]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("launch", ["torchrun, SIGTERM to rank 1", "--nproc 2, Ctrl-C"])
def test_stage1_sigterm_to_one_rank_saves_and_resumes(stage1_straight, tmp_path, launch):
    """Stopped by a signal mid-run and continued by the same command, the run ends bit for bit
    where the straight torchrun run did; with `--nproc 2` this also shows that the script's own
    launcher and torchrun give the same weights."""
    run_dir = tmp_path / "preempted"
    steps = RESUME_STEPS
    # No periodic states: the only state before the end is the one the signal makes.
    make_cmd = stage1_cmd if launch.startswith("torchrun") else spawn_cmd
    cmd = make_cmd(run_dir, steps, "n_imgs_per_ckpt_save=100000")
    proc = popen(cmd, base_env(1), REPO)
    wait_for_records(run_dir, 1, proc)
    if launch.startswith("torchrun"):
        os.kill(worker_pids(proc.pid)[1], signal.SIGTERM)
    else:  # a terminal's Ctrl-C reaches the parent and its ranks; the parent forwards it too
        os.killpg(proc.pid, signal.SIGINT)
    code, out = finish(proc, timeout=60)
    assert code == 0, out[-4000:]
    assert f"run the same command with run_dir={run_dir} to resume" in out
    assert "aborting" not in out and "Traceback" not in out
    saved = sorted((run_dir / "checkpoints").glob("state_*.pt"))
    assert len(saved) == 1 and not (run_dir / "model_final.pth").exists()
    stopped_at = load_state(saved[0])["step"]
    # mid-run (usually inside a metrics window: 9 times in 10 the step is not a multiple of 10)
    assert 0 < stopped_at < steps, stopped_at
    run_command(cmd, timeout=150, env=base_env(1)).assert_ok()
    assert_states_identical(load_state(stage1_straight, steps), load_state(run_dir, steps))
    assert (run_dir / "model_final.pth").exists()
    straight, resumed = (comparable(read_metrics(d)) for d in (stage1_straight, run_dir))
    assert len(straight) == len(resumed) == steps // 10
    for a, b in zip(straight, resumed, strict=True):
        assert a == pytest.approx(b, rel=1e-12)  # the window's sums may add in another order


@pytest.mark.timeout(120)
def test_a_state_of_the_other_stage_is_a_clear_error(stage1_straight, tmp_path):
    state = load_state(stage1_straight, RESUME_STEPS)
    path = state_path(stage1_straight, RESUME_STEPS)
    assert state["stage"] == 1
    result = run_train(["experiments/quickstart/digits.yaml", f"resume_from_state={path}",
                        "max_steps=300"], run_dir=tmp_path / "dat", timeout=100)
    assert result.returncode == 2, result.output[-3000:]
    assert "stage-1 training state" in result.output and "Traceback" not in result.output
