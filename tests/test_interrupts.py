"""Signals and failures on one rank (docs/distributed.md, "Preemption" and "Failures"): a second
Ctrl-C aborts while a launcher's echo does not; SIGTERM during an evaluation saves within
torchrun's grace period; the SLURM recipe's trap saves and requeues; a failed rank-0 write or a
checkpoint missing on one rank ends every rank with one line, no hang."""

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from rebm.checkpoint.run_directory import RunDirectory, RunDirError
from rebm.distributed.launch import free_port
from rebm.distributed.logs import LogFileError, setup_logging
from rebm.distributed.runtime import Runtime
from tests.helpers import (
    CONFIG,
    FAST,
    REPO,
    base_env,
    error_lines,
    finish,
    read_metrics,
    rebm_traceback_lines,
    run_train,
    start_torchrun,
    wait_for_records,
)

pytestmark = pytest.mark.timeout(300)

FLAG_SCRIPT = textwrap.dedent("""
    import os, signal, time
    from rebm.distributed.signals import PreemptionFlag
    flag = PreemptionFlag().install()
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)  # a launcher's copy of the same Ctrl-C
    time.sleep(0.1)
    print("after echo:", flag.signal_name, flush=True)
    time.sleep(1.5)
    os.kill(os.getpid(), signal.SIGINT)  # a real second Ctrl-C
    time.sleep(5)
    print("still running", flush=True)
""")


def test_a_second_interrupt_aborts_but_an_echo_does_not():
    proc = subprocess.run([sys.executable, "-c", FLAG_SCRIPT], cwd=REPO, env=base_env(1),
                          capture_output=True, text=True, timeout=60)
    assert "after echo: SIGINT" in proc.stdout
    assert "still running" not in proc.stdout
    assert proc.returncode == 130
    assert "second interrupt: aborting without saving" in proc.stderr


# One evaluation, at the last step (2): robust accuracy with many PGD steps, so it is running
# when the signal comes.
EVAL_SLOW = [CONFIG, *FAST, "max_steps=2", "n_imgs_per_ckpt_save=100000",
             "n_imgs_per_evaluation_log=64", "robust_eval_steps=40"]


@pytest.mark.slow
def test_sigterm_during_an_evaluation_saves_in_the_grace_period_and_resume_runs_it(tmp_path):
    """SIGTERM to torchrun's agent (what SLURM does) while every rank is inside the evaluation
    at step 2: the ranks agree at the next evaluation batch, abandon it, save, exit; the same
    command then runs that evaluation first and finishes."""
    run_dir = tmp_path / "run"
    proc = start_torchrun(EVAL_SLOW, run_dir)
    log = run_dir / "logs" / "rank0.log"
    deadline = time.time() + 180
    while not (log.exists() and "evaluating at step 2" in log.read_text()):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.2)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc, timeout=60)
    assert time.monotonic() - sent < 30, "not within torchrun's default 30 s grace period"
    assert "state saved at step 2" in out and "interrupted evaluation runs first" in out, out
    assert [p.name for p in (run_dir / "checkpoints").glob("state_*.pt")] == [
        "state_000000002.pt"]
    # the starting model's and the start of step 2's; the final one was abandoned
    assert [r["step"] for r in read_metrics(run_dir) if "test_acc" in r] == [0, 1]

    run_train(EVAL_SLOW, nproc=2, run_dir=run_dir, timeout=300).assert_ok()
    evaluated = [r["step"] for r in read_metrics(run_dir) if "test_acc" in r]
    assert evaluated == [0, 1, 2]  # the pending (final) evaluation, once
    assert (run_dir / "model_final.pth").exists()


def _fake_slurm_bin(folder, log):
    """`srun` runs its command (dropping its own options); `scontrol` answers `show hostnames`
    and records every call. The training, torchrun and the signals are real."""
    folder.mkdir()
    (folder / "srun").write_text(
        '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (folder / "scontrol").write_text(
        f'#!/bin/bash\necho "$@" >> {log}\n'
        'if [ "$1" = show ]; then echo localhost; fi\n')
    for name in ("srun", "scontrol"):
        (folder / name).chmod((folder / name).stat().st_mode | stat.S_IXUSR)


@pytest.mark.slow
def test_the_slurm_recipe_saves_and_requeues_on_the_warning_signal(tmp_path):
    run_dir = tmp_path / "run"
    calls = tmp_path / "scontrol.log"
    _fake_slurm_bin(tmp_path / "bin", calls)
    env = base_env(1, {
        "PATH": f"{tmp_path / 'bin'}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "dat", "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "localhost", "GPUS_PER_NODE": "2", "RDZV_PORT": str(free_port()),
        "CONFIG": CONFIG, "RUN_DIR": str(run_dir), "GRACE_S": "60"})
    proc = subprocess.Popen(
        ["bash", "experiments/slurm/dat.sbatch", *FAST, "max_steps=400",
         "n_imgs_per_ckpt_save=100000"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    wait_for_records(run_dir, 1, proc)
    proc.send_signal(signal.SIGUSR1)  # SLURM's --signal=B:USR1@300 goes to the batch shell
    code, out = finish(proc, timeout=120)
    assert code == 0, out[-4000:]
    assert "stopped by SIGTERM" in out and "requeueing job 4242" in out
    assert "requeue 4242" in calls.read_text()
    assert len(list((run_dir / "checkpoints").glob("state_*.pt"))) == 1


@pytest.mark.slow
def test_a_failed_rank0_write_mid_run_ends_every_rank_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "samples").write_text("a file where the samples folder goes")
    # the first sample grid is due at step 2 of 4 (after a state at step 1 was written)
    result = run_train([CONFIG, *FAST, "max_steps=4", "n_imgs_per_image_log=64"], nproc=2,
                       run_dir=run_dir, timeout=240)
    assert result.returncode != 0
    errors = [line for line in error_lines(result.output) if "] error:" in line]
    assert len(errors) == 1, result.output[-4000:]  # one line per job: the rank that met it
    assert errors[0].startswith("[rank 0] error: cannot write"), errors
    assert "(File exists; " in errors[0] and "free on its filesystem" in errors[0], errors
    assert not rebm_traceback_lines(result.output)


@pytest.mark.slow
def test_a_checkpoint_missing_on_one_rank_ends_every_rank_with_one_line(tmp_path):
    """model.ckpt_path differs per rank (OmegaConf's env resolver), as when one node lacks it."""
    ckpt = tmp_path / "ckpt_0.pth"
    from rebm.config import load_config
    from rebm.models import model_from_config

    cfg = load_config(CONFIG)
    torch.save(model_from_config(cfg.model, cfg.data).state_dict(), ckpt)
    result = run_train([CONFIG, *FAST, "max_steps=2",
                        f"model.ckpt_path={tmp_path}/ckpt_${{oc.env:RANK}}.pth"],
                       nproc=2, run_dir=tmp_path / "run", timeout=240)
    assert result.returncode != 0
    errors = [line for line in error_lines(result.output) if "] error:" in line]
    assert len(errors) == 1, result.output[-4000:]  # the rank that lacks it, not rank 0's echo
    assert errors[0].startswith("[rank 1] error:") and "ckpt_1.pth" in errors[0], errors
    assert not rebm_traceback_lines(result.output)


def test_run_dir_checks(tmp_path):
    (tmp_path / ".shared_check").write_text("token-of-rank-0\n")
    RunDirectory(str(tmp_path)).check_shared("token-of-rank-0", Runtime())
    with pytest.raises(RunDirError, match="filesystem shared by all nodes"):
        RunDirectory(str(tmp_path)).check_shared("another-token", Runtime(rank=1, world_size=2))

    (tmp_path / "checkpoints").mkdir()
    stale = [tmp_path / "checkpoints" / ".state_000000004.pt.x1y2.tmp",
             tmp_path / "metrics.jsonl.tmp", tmp_path / ".model_final.pth.ab.tmp"]
    for path in stale:
        path.write_bytes(b"partial")
    RunDirectory(str(tmp_path)).remove_stale_temp_files()
    assert not any(path.exists() for path in stale)


def test_a_log_file_that_cannot_be_created_is_one_line(tmp_path):
    (tmp_path / "logs").write_text("a file where the logs folder goes")  # fails for root too
    with pytest.raises(LogFileError, match="cannot write the log file"):
        setup_logging(Runtime(), RunDirectory(str(tmp_path)).log_file(0))
