"""What the entry points print, captured from real processes with output to a pipe (as under
make, SLURM or nohup): a one-line summary per metrics log, no wandb chatter, hints that work
(a run directory as model.ckpt_path, the -<hash> sibling named when a path is missing, the
FID stand-in), one line for a bad WANDB_MODE on every entry point, the new-run notice, the
interrupt notice once from rank 0, a files line that lists what the run wrote."""

from __future__ import annotations

import glob
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from rebm.distributed.launch import free_port
from rebm.distributed.precision import native_on_cpu
from rebm.standin.writers import write_fake_cifar10
from tests.helpers import REPO, base_env, error_lines, finish, rebm_traceback_lines, torchrun_cmd
from tests.processes import popen
from tests.wandb_files import offline_runs, read_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CONFIG = str(REPO / "experiments" / "quickstart" / "digits.yaml")
CIFAR_STAGE2 = str(REPO / "experiments" / "cifar10" / "cifar10-dat-WideResNet34x10-T40-seed0.yaml")
TINY = ["batch_size=32", "attack.max_steps=1", "attack.start_step=1",
        "indist_attack_clf.max_steps=1", "n_imgs_per_evaluation_log=null",
        "n_imgs_per_metrics_log=32"]
TRAIN = ["-m", "rebm.training.train"]
ENTRY_POINTS = {
    "train": TRAIN,
    "train_at.py": [str(REPO / "InNOutRobustnessMean0_cifar100" / "train_at.py")],
    "evaluate": ["-m", "rebm.eval.evaluate"],
    "fid_stats": ["-m", "rebm.eval.fid_stats"],
}


def _env(**extra: str) -> dict:
    env = base_env(1, {"PYTHONPATH": str(REPO), "REBM_PROGRESS": "0", **extra})
    for key in ("WANDB_SILENT", "WANDB_QUIET", "REBM_FID_FEATURES"):
        if key not in extra:
            env.pop(key, None)
    return env


def _run(cmd, cwd: Path, env: dict, timeout: float = 400) -> tuple:
    """(exit code, stdout+stderr) of cmd with its output to a pipe."""
    return finish(popen(cmd, env, cwd), timeout)


def _lines(out: str, pattern: str) -> list:
    return [line for line in out.splitlines() if re.search(pattern, line)]


@pytest.fixture(scope="module")
def dat_run(tmp_path_factory):
    """DAT under torchrun on 2 CPU processes, no run_dir (the default one, with the -<hash> of
    the overrides), wandb on and WANDB_MODE set but empty (`export WANDB_MODE=`)."""
    cwd = tmp_path_factory.mktemp("console")
    code, out = _run(torchrun_cmd("rebm.training.train",
                                  [CONFIG, *TINY, "max_steps=2", "wandb_disabled=false"], 2),
                     cwd, _env(WANDB_MODE=""))
    assert code == 0, out[-4000:]
    (run_dir,) = glob.glob(str(cwd / "runs" / "quickstart" / "digits-*"))
    return cwd, Path(run_dir), out


def test_empty_wandb_mode_is_unset_and_wandb_stays_quiet(dat_run):
    _, run_dir, out = dat_run
    (folder,) = offline_runs(run_dir)  # auto without an API key: offline
    assert read_run(folder)["name"] == run_dir.name
    assert not _lines(out, r"^wandb:"), out  # no banner, no run history or summary
    assert _lines(out, rf"wandb offline run \w+; upload it with `wandb sync {folder}`")


def test_a_summary_line_per_metrics_log_without_a_progress_bar(dat_run):
    _, run_dir, out = dat_run
    summaries = _lines(out, r"\[rank 0/2\] INFO step \d/2 \(epoch 0\): ")
    assert [line.split(" INFO ")[1].split(" (")[0] for line in summaries] == ["step 1/2",
                                                                            "step 2/2"], out
    assert "train_clf_loss " in summaries[0] and "imgs_per_s " in summaries[0]
    (files,) = _lines(out, r"INFO files in ")
    # samples/: the first step's preview grid (the original's trigger fires at the first step)
    assert files.endswith(f"files in {run_dir}: model_final.pth (evaluated weights), "
                          "metrics.jsonl, samples/, checkpoints/ (training states; the same "
                          "command continues the run), logs/, wandb/"), files


def test_a_changed_training_key_names_the_existing_run_and_the_keys(dat_run):
    """Without run_dir, lr=0.01 starts a new run: one line says so. amp=bf16 on a CPU that
    emulates bf16 warns once for the two ranks."""
    cwd, run_dir, _ = dat_run
    code, out = _run(torchrun_cmd("rebm.training.train", [CONFIG, *TINY, "max_steps=1",
                                                          "lr=0.01", "amp=bf16"], 2),
                     cwd, _env())
    assert code == 0, out[-4000:]
    (notice,) = _lines(out, r"INFO new run in ")
    relative = os.path.relpath(run_dir, cwd)
    assert f"the existing run {relative} differs in " in notice, notice
    assert "amp: 'none' -> 'bf16'" in notice and "lr: 0.001 -> 0.01" in notice, notice
    if not native_on_cpu("bf16"):
        assert len(_lines(out, r"amp=bf16: this CPU has no native bf16")) == 1, out


def test_evaluate_takes_the_run_directory_and_names_hashed_siblings(dat_run):
    cwd, run_dir, _ = dat_run
    args = [CONFIG, "robust_eval_steps=1", "data.num_workers=0"]
    code, out = _run([sys.executable, "-m", "rebm.eval.evaluate", *args,
                      f"model.ckpt_path={os.path.relpath(run_dir, cwd)}", "--no-ece"], cwd, _env())
    assert code == 0, out[-4000:]
    assert f'"ckpt_path": "{run_dir / "model_final.pth"}"' in out.splitlines()[-1]

    readme_path = os.path.join("runs", "quickstart", "digits", "model_final.pth")
    code, out = _run([sys.executable, "-m", "rebm.eval.evaluate", *args,
                      f"model.ckpt_path={readme_path}"], cwd, _env())
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert f"model.ckpt_path '{readme_path}' does not exist; runs of the same config here: " \
           in out and os.path.relpath(run_dir, cwd) in out, out


def test_fid_stats_without_inception_weights_names_the_stand_in(tmp_path):
    """Statistics always need a feature network: no hint to set image_log.log_fid=false."""
    code, out = _run([sys.executable, "-m", "rebm.eval.fid_stats", CONFIG, "--out",
                      str(tmp_path / "stats.npz"), "image_log.log_fid=false"], REPO,
                     _env(TORCH_HOME=str(tmp_path / "torch_home")))
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert "REBM_FID_FEATURES=rebm.eval.standin:features computes STAND-IN" in out, out
    assert "log_fid=false" not in out, out
    assert "image_log.inception_weights=PATH" in out


def test_check_counts_the_training_images_against_batch_size(tmp_path):
    write_fake_cifar10(str(tmp_path / "data" / "CIFAR10"), n_train=96, n_test=20)
    code, out = _run([sys.executable, *TRAIN, CIFAR_STAGE2, "--check"], tmp_path, _env())
    assert code == 0, out[-3000:]
    assert ("warning: batch_size=128 is larger than the 96 training images of "
            "cifar10-conditional; training would stop at start") in out, out
    code, out = _run([sys.executable, *TRAIN, CIFAR_STAGE2, "--check", "batch_size=32"],
                     tmp_path, _env())
    assert "note: 96 training images of cifar10-conditional, 3 steps per epoch at " \
           "batch_size=32" in out, out


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_an_unknown_wandb_mode_is_one_line_on_every_entry_point(entry, tmp_path):
    extra = ["--out", str(tmp_path / "s.npz")] if entry == "fid_stats" else []
    code, out = _run([sys.executable, *ENTRY_POINTS[entry], CONFIG, *extra], REPO,
                     _env(WANDB_MODE="ofline"), timeout=120)
    assert code == 2, out
    assert out.strip() == ("error: environment variable WANDB_MODE='ofline' is not a wandb "
                           "mode; set it to online, offline or disabled, or unset it"), out


def test_an_unknown_wandb_mode_under_torchrun_is_one_line_per_job(tmp_path):
    """Every rank meets it; rank 0 reports it and torchrun stops the other before it does."""
    code, out = _run(torchrun_cmd("rebm.training.train", [CONFIG, *TINY, "max_steps=1",
                                                          "wandb_disabled=false"], 2),
                     tmp_path, _env(WANDB_MODE="ofline"), timeout=120)
    assert code != 0
    assert len([line for line in error_lines(out) if "] error:" in line]) == 1, out
    assert len(_lines(out, r"^\[rank 0\] error: environment variable "
                           r"WANDB_MODE='ofline' is not a wandb mode")) == 1, out
    assert not rebm_traceback_lines(out) and not (tmp_path / "runs").exists(), out


def test_the_interrupt_notice_comes_once_from_rank_0_under_srun(tmp_path):
    """Two tasks as srun starts them (SLURM_PROCID, no RANK), one Ctrl-C to both."""
    port = str(free_port())
    cmd = [sys.executable, *TRAIN, CONFIG, *TINY, "max_steps=400", f"run_dir={tmp_path / 'run'}"]
    procs = []
    for task in (0, 1):
        env = _env(SLURM_PROCID=str(task), SLURM_LOCALID=str(task), SLURM_STEP_NUM_TASKS="2",
                   SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port)
        procs.append(popen(cmd, env, REPO))
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not metrics.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    for proc in procs:
        os.killpg(proc.pid, signal.SIGINT)
    outs = [finish(proc, 240)[1] for proc in procs]
    notices = [line for out in outs for line in _lines(out, "interrupt: saving")]
    assert notices == ["[rank 0/2] interrupt: saving the training state at the next step, then "
                       "exiting (interrupt again to abort without saving)"], outs
    assert _lines(outs[0], "stopped by SIGINT: state saved at step"), outs[0]
