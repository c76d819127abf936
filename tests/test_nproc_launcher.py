"""The `--nproc` launcher's ranks die with it, as torchrun's workers die with their agent
(tests/test_faults_start.py, test_workers_die_with_their_torchrun_agent): `kill -9` of the
launcher alone, and its ranks get SIGTERM from the kernel, save a state and exit, saying that
their launcher ended. Real processes: stage 1's train_at.py with two spawned ranks (gloo)."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

from tests.helpers import REPO, base_env, process_alive, wait_for_records
from tests.processes import popen

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TRAIN_AT = str(REPO / "InNOutRobustnessMean0_cifar100" / "train_at.py")
CONFIG = "experiments/quickstart/digits_stage1.yaml"
# Trains on until stopped: no state before the one the signal makes, no evaluation.
ENDLESS = ["batch_size=32", "indist_attack_clf.max_steps=1", "n_imgs_per_metrics_log=64",
           "n_imgs_per_evaluation_log=null", "n_imgs_per_ckpt_save=100000000",
           "max_steps=100000", "total_epochs=null", "model.compile=false"]


def _spawned_ranks(launcher: int) -> list:
    """The pids of the ranks `launcher` spawned (multiprocessing's spawn_main children; not
    its resource tracker). Their RANK is set after they start, so /proc/PID/environ lacks it."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        if ppid == launcher and b"spawn_main" in cmdline:
            found.append(int(pid))
    return found


def test_spawned_ranks_die_with_their_launcher(tmp_path):
    run_dir = tmp_path / "run"
    launcher = popen([sys.executable, TRAIN_AT, CONFIG, "--nproc", "2", *ENDLESS,
                      f"run_dir={run_dir}"], base_env(1), REPO)
    ranks = []
    try:
        wait_for_records(run_dir, 1, launcher)
        ranks = _spawned_ranks(launcher.pid)
        assert len(ranks) == 2, ranks
        os.kill(launcher.pid, signal.SIGKILL)
        killed = time.time()
        while any(process_alive(pid) for pid in ranks) and time.time() < killed + 60:
            time.sleep(0.2)
        survivors = [pid for pid in ranks if process_alive(pid)]
    finally:
        for pid in ranks:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
    output = launcher.communicate(timeout=30)[0]
    assert launcher.returncode == -signal.SIGKILL
    assert survivors == [], f"ranks {survivors} outlived their launcher\n{output[-3000:]}"
    # SIGTERM, as under torchrun (torch's own parent-death signal for spawned processes is
    # SIGINT, which a rank takes for a Ctrl-C)
    stopped = re.findall(r"\[rank 0/2\] WARNING stopped by SIGTERM \(its launcher, pid (\d+), "
                         r"ended\): state saved at step \d+; run the same command with "
                         r"run_dir=\S+ to resume", output)
    assert stopped == [str(launcher.pid)], output[-3000:]
    assert "interrupt" not in output and "Traceback" not in output, output[-3000:]
    assert list((run_dir / "checkpoints").glob("state_*.pt"))
