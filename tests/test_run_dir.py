"""What a shipped config does as a user runs it: real wandb (offline), the same command resumes
(deterministic run dir), a changed training config is refused, and one job per run dir."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rebm.checkpoint.run_directory import RunDirLock
from rebm.config import default_run_dir, load_config, to_dict
from tests.helpers import (
    CONFIG,
    FAST,
    REPO,
    STRAIGHT_STEPS,
    copy_run,
    error_lines,
    run_command,
    run_train,
)
from tests.wandb_files import offline_runs, read_run

pytestmark = pytest.mark.timeout(300)

SMALL = ["batch_size=32", "attack.max_steps=2", "attack.start_step=1",
         "indist_attack_clf.max_steps=1", "n_imgs_per_metrics_log=64",
         "n_imgs_per_evaluation_log=128", "n_imgs_per_ckpt_save=64", "image_log.num_samples=10",
         "image_log.num_steps=2", "robust_eval_steps=1"]
WANDB_OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def metrics_keys(run_dir):
    with open(run_dir / "metrics.jsonl") as fh:
        return [set(json.loads(line)) - {"step"} for line in fh]


@pytest.mark.slow
def test_wandb_offline_two_ranks_and_the_same_command_continues_the_run(tmp_path):
    run_dir = tmp_path / "run"
    first = run_train([CONFIG, *SMALL, "wandb_disabled=false", "max_steps=4"], nproc=2,
                      run_dir=run_dir, extra_env=WANDB_OFFLINE).assert_ok()
    again = run_train([CONFIG, *SMALL, "wandb_disabled=false", "max_steps=8"], nproc=2,
                      run_dir=run_dir, extra_env=WANDB_OFFLINE).assert_ok()
    assert "resumed from" in again.output and "at step 4" in again.output, again.output[-2000:]
    folders = offline_runs(run_dir)
    assert len(folders) == 2, folders  # rank 0 only: one wandb run per attempt
    runs = [read_run(folder) for folder in folders]
    assert runs[0]["id"] == runs[1]["id"]  # the same wandb run continues
    assert {r["name"] for r in runs} == {"run"}  # named after the run dir
    logged = [keys for r in runs for keys in r["history"]]
    for keys in metrics_keys(run_dir):  # every metrics.jsonl key reached wandb
        assert any(keys <= wandb_keys for wandb_keys in logged), keys
    assert any(any(k.startswith("images/gen_samples") for k in ks) for ks in logged)  # grid
    assert any(any(k.startswith("eval/table") for k in ks) for ks in logged)  # eval table
    assert "Traceback" not in first.output


@pytest.mark.slow
def test_default_run_dir_is_the_config_name_and_survives_length_overrides():
    assert default_run_dir("experiments/cifar10/dat.yaml", []) == "runs/cifar10/dat"
    assert default_run_dir("experiments/cifar100/dat.yaml", []) == "runs/cifar100/dat"
    assert default_run_dir("x/dat.yaml", ["max_steps=10", "total_epochs=3"]) == "runs/x/dat"
    assert default_run_dir("x/dat.yaml", ["model.trust_checkpoint=true"]) == "runs/x/dat"
    config = str(REPO / CONFIG)
    other = default_run_dir(config, ["lr=0.01"], to_dict(load_config(config, ["lr=0.01"])))
    assert other.startswith("runs/quickstart/digits-")
    assert other == default_run_dir(config, ["lr=1e-2"], to_dict(load_config(config, ["lr=1e-2"])))
    assert other != default_run_dir(config, ["lr=0.02"], to_dict(load_config(config, ["lr=0.02"])))
    result = run_command([sys.executable, "-m", "rebm.training.train", CONFIG, "max_steps=7",
                          "--check"], timeout=120).assert_ok()
    assert "run_dir: runs/quickstart/digits\n" in result.output


@pytest.mark.slow
@pytest.mark.timeout(900)  # it may be the first test to wait for the session's reference runs
def test_a_changed_training_config_is_refused_unless_forced(straight, tmp_path):
    """A copy of the session's finished 20-step run, continued with another lr."""
    run_dir = copy_run(straight / "ws1", tmp_path / "run")
    before = (run_dir / "metrics.jsonl").read_text()
    steps = STRAIGHT_STEPS + 1
    refused = run_train([CONFIG, *FAST, f"max_steps={steps}", "lr=0.5"], run_dir=run_dir)
    assert refused.returncode == 2, refused.output[-3000:]
    assert "lr: 0.005 -> 0.5" in refused.output and "resume=force" in refused.output
    assert "Traceback" not in refused.output
    assert (run_dir / "metrics.jsonl").read_text() == before  # nothing written
    forced = run_train([CONFIG, *FAST, f"max_steps={steps}", "lr=0.5", "resume=force"],
                       run_dir=run_dir).assert_ok()
    assert f"at step {STRAIGHT_STEPS}" in forced.output


@pytest.mark.slow
def test_a_second_job_on_the_same_run_dir_stops_and_the_first_is_untouched(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from rebm.checkpoint.run_directory import RunDirLock; "
         f"lock = RunDirLock({str(run_dir)!r}); print('locked', flush=True); time.sleep(60)"],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        in_use = f"run_dir '{run_dir}' is in use by pid {holder.pid}"
        second = run_train([CONFIG, *SMALL, "max_steps=2"], nproc=2, run_dir=run_dir)
        assert second.returncode != 0 and in_use in second.output, second.output[-3000:]
        alone = run_train([CONFIG, *SMALL, "max_steps=2"], run_dir=run_dir)
        assert alone.returncode == 2 and in_use in alone.output
        assert "Traceback" not in alone.output  # one line (torchrun's agent adds its own)
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # nothing written
    finally:
        holder.kill()
        holder.wait()
    RunDirLock(str(run_dir)).release()  # the killed holder's lock is free for the next job


def test_wandb_mode_precedence(monkeypatch):
    """A config that says no wandb gets none; otherwise WANDB_MODE wins over wandb_mode."""
    from rebm.engine.tracking import wandb_mode

    config = str(REPO / CONFIG)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_mode(load_config(config, ["wandb_disabled=true"]).logging) == "disabled"
    assert wandb_mode(load_config(config, ["wandb_mode=disabled"]).logging) == "disabled"
    online = ["wandb_disabled=false", "wandb_mode=online"]  # the quickstart config disables it
    assert wandb_mode(load_config(config, online).logging) == "offline"
    monkeypatch.delenv("WANDB_MODE")
    assert wandb_mode(load_config(config, online).logging) == "online"


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_wrong_starting_checkpoint_stops_before_anything_is_written(tmp_path, nproc):
    """A new run whose model.ckpt_path does not exist stops with one line naming the key, and
    leaves no run directory behind (no logs/, no lock): the inputs are checked first."""
    missing = tmp_path / "no_such_model.pth"
    run_dir = tmp_path / "runs" / "dat"
    result = run_train(["experiments/quickstart/digits_stage2.yaml",
                        f"model.ckpt_path={missing}"], nproc=nproc, timeout=120, run_dir=run_dir)
    assert result.returncode != 0
    errors = error_lines(result.output)
    assert len(errors) == 1 and f"model.ckpt_path '{missing}' does not exist" in errors[0], \
        result.output[-3000:]
    assert not run_dir.exists() and not run_dir.parent.exists()
