"""Exact O(1) resume, preemption and failure handling with the real entry point."""

import hashlib
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import (
    REPO,
    base_env,
    finish,
    run_train,
    torchrun_cmd,
)
from tests.test_train import CONFIG, FAST, load_state, max_param_diff, read_metrics

pytestmark = pytest.mark.timeout(420)

STEPS = 8
STOP = 3  # odd: the stop falls inside a metrics window (metrics every 2 steps)
LOG2 = "n_imgs_per_metrics_log=64"
TIMING_KEYS = {"imgs_per_s", "max_rss_mib"}  # wall-clock and memory differ between any two runs


def comparable(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


def assert_states_identical(a, b):
    for part in ("model", "ema"):
        assert set(a[part]) == set(b[part])
        for key in a[part]:
            if torch.is_tensor(a[part][key]):
                assert torch.equal(a[part][key], b[part][key]), (part, key)
    opt_a, opt_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert opt_a.keys() == opt_b.keys()
    for idx in opt_a:
        for name, value in opt_a[idx].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_b[idx][name]))
    for part in ("method", "scheduler"):  # e.g. DAT's curriculum, stage 1's LR schedule
        assert a.get(part) == b.get(part), part


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted reference runs of STEPS steps at world size 1 and 2."""
    root = tmp_path_factory.mktemp("straight")
    for nproc in (1, 2):
        run_train([CONFIG, *FAST, LOG2, f"max_steps={STEPS}"], nproc=nproc,
                  run_dir=root / f"ws{nproc}", timeout=300).assert_ok()
    return root


@pytest.mark.parametrize("nproc", [1, 2])
def test_stop_and_resume_is_bit_identical(straight, tmp_path, nproc):
    run_dir = tmp_path / "run"
    run_train([CONFIG, *FAST, LOG2, f"max_steps={STOP}"], nproc=nproc, run_dir=run_dir,
              timeout=300).assert_ok()
    result = run_train([CONFIG, *FAST, LOG2, f"max_steps={STEPS}"], nproc=nproc,
                       run_dir=run_dir, timeout=300).assert_ok()
    assert f"at step {STOP}" in result.output  # it resumed rather than restarted
    assert_states_identical(load_state(straight / f"ws{nproc}", STEPS), load_state(run_dir, STEPS))
    assert comparable(read_metrics(run_dir)) == comparable(read_metrics(straight / f"ws{nproc}"))


def test_resume_does_not_need_the_pretrained_checkpoint_any_more(straight, tmp_path):
    """The state holds the weights: a resumed run must not read model.ckpt_path (on a cluster
    the stage-1 file may have been moved or deleted since the run started)."""
    pretrained = tmp_path / "pretrained.pth"
    shutil.copy(straight / "ws1" / "model_final.pth", pretrained)
    run_dir = tmp_path / "run"
    args = [CONFIG, *FAST, f"model.ckpt_path={pretrained}"]
    first = run_train([*args, f"max_steps={STOP}"], run_dir=run_dir, timeout=300).assert_ok()
    assert f"loaded checkpoint '{pretrained}'" in first.output
    pretrained.unlink()
    result = run_train([*args, f"max_steps={STOP + 1}"], run_dir=run_dir,
                       timeout=300).assert_ok()
    assert f"at step {STOP}" in result.output and "loaded checkpoint" not in result.output
    # a fresh run with the missing file still fails clearly
    fresh = run_train([*args, "max_steps=1"], run_dir=tmp_path / "fresh", timeout=300)
    assert fresh.returncode == 2 and str(pretrained) in fresh.output


def test_resume_on_a_different_world_size(straight, tmp_path):
    run_dir = tmp_path / "run"
    run_train([CONFIG, *FAST, LOG2, f"max_steps={STOP}"], nproc=2, run_dir=run_dir,
              timeout=300).assert_ok()
    run_train([CONFIG, *FAST, LOG2, f"max_steps={STEPS}"], nproc=1, run_dir=run_dir,
              timeout=300).assert_ok()
    a, b = load_state(straight / "ws2", STEPS), load_state(run_dir, STEPS)
    assert max_param_diff(a["model"], b["model"]) <= 1e-4


def _startup_seconds(run_dir):
    text = (run_dir / "logs" / "rank0.log").read_text()
    return float(re.findall(r"first batch after ([0-9.]+)s", text)[-1])


def test_resume_cost_does_not_grow_with_the_step(straight, tmp_path):
    seconds = {}
    for step in (10, 2000):
        run_dir = tmp_path / f"at{step}"
        state = load_state(straight / "ws1", STEPS)
        state["step"] = step  # the data position is derived from the step alone
        os.makedirs(run_dir / "checkpoints")
        torch.save(state, run_dir / "checkpoints" / f"state_{step:09d}.pt")
        run_train([CONFIG, *FAST, f"max_steps={step + 1}", "total_epochs=null"],
                  run_dir=run_dir, timeout=300).assert_ok()
        seconds[step] = _startup_seconds(run_dir)
    assert abs(seconds[2000] - seconds[10]) < 1.0, seconds


def _worker_pids(agent_pid):
    """{rank: pid} of the workers a torchrun agent started (read from their environment)."""
    pids = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            if ppid != agent_pid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = dict(item.split(b"=", 1) for item in fh.read().split(b"\0") if b"=" in item)
            pids[int(env[b"RANK"])] = int(pid)
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return pids


def _start_torchrun(args, run_dir, extra=(), threads=1, env_extra=None):
    cmd = torchrun_cmd("rebm.training.train", [*args, f"run_dir={run_dir}"], 2)
    cmd[1:1] = list(extra)
    return subprocess.Popen(cmd, cwd=REPO, env=base_env(threads, env_extra),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait_for_records(run_dir, count, proc, timeout=180):
    deadline = time.time() + timeout
    path = run_dir / "metrics.jsonl"
    while time.time() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        time.sleep(0.2)
    pytest.fail("training did not make progress")


def test_sigterm_to_one_rank_saves_and_same_command_resumes(straight, tmp_path):
    run_dir = tmp_path / "run"
    args = [CONFIG, *FAST, LOG2, f"max_steps={STEPS}", "n_imgs_per_ckpt_save=100000"]
    proc = _start_torchrun(args, run_dir)
    _wait_for_records(run_dir, 1, proc)
    os.kill(_worker_pids(proc.pid)[1], signal.SIGTERM)
    code, out = finish(proc, timeout=30)
    assert code == 0, out[-4000:]
    assert f"run the same command with run_dir={run_dir} to resume" in out
    assert list((run_dir / "checkpoints").glob("state_*.pt"))
    run_train(args, nproc=2, run_dir=run_dir, timeout=300).assert_ok()
    assert_states_identical(load_state(straight / "ws2", STEPS), load_state(run_dir, STEPS))


def test_sigkill_of_a_worker_ends_the_job_and_max_restarts_resumes(tmp_path):
    args = [CONFIG, *FAST, "max_steps=30"]
    proc = _start_torchrun(args, tmp_path / "plain")
    _wait_for_records(tmp_path / "plain", 2, proc)
    os.kill(_worker_pids(proc.pid)[1], signal.SIGKILL)
    code, out = finish(proc, timeout=60)
    assert code != 0

    run_dir = tmp_path / "elastic"
    proc = _start_torchrun([CONFIG, *FAST, "max_steps=12"], run_dir, extra=["--max-restarts=1"])
    _wait_for_records(run_dir, 3, proc)
    os.kill(_worker_pids(proc.pid)[1], signal.SIGKILL)
    code, out = finish(proc, timeout=300)
    assert code == 0, out[-4000:]
    assert "resumed from" in (run_dir / "logs" / "rank0.log").read_text()
    assert load_state(run_dir, 12)["step"] == 12


def test_stuck_rank_times_out_naming_the_rank(tmp_path):
    run_dir = tmp_path / "run"
    # No periodic saves: around a save the longer start-up timeout applies (rank 0 may write
    # a large state), and this test is about a rank that stops during training steps.
    proc = _start_torchrun([CONFIG, *FAST, "max_steps=400", "ddp_step_timeout_s=15",
                            "n_imgs_per_ckpt_save=100000"], run_dir)
    _wait_for_records(run_dir, 2, proc)
    stuck = _worker_pids(proc.pid)[1]
    os.kill(stuck, signal.SIGSTOP)
    try:
        code, out = finish(proc, timeout=240)
    finally:
        try:
            os.kill(stuck, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert code != 0
    assert re.search(r"rank 1\b", out), out[-4000:]


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_corrupt_newest_state_falls_back_to_previous(tmp_path):
    run_dir = tmp_path / "run"
    run_train([CONFIG, *FAST, "max_steps=4"], run_dir=run_dir, timeout=300).assert_ok()
    newest = run_dir / "checkpoints" / "state_000000004.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, like a crash mid-copy
    result = run_train([CONFIG, *FAST, "max_steps=6"], run_dir=run_dir, timeout=300).assert_ok()
    assert "state_000000004.pt" in result.output and "unreadable" in result.output
    assert "at step 3" in result.output
    assert load_state(run_dir, 6)["step"] == 6


def test_failing_state_write_is_a_clear_error_and_keeps_previous(tmp_path):
    run_dir = tmp_path / "run"
    run_train([CONFIG, *FAST, "max_steps=2", "keep_last_states=1"], run_dir=run_dir,
              timeout=300).assert_ok()
    previous = run_dir / "checkpoints" / "state_000000002.pt"
    digest = _sha(previous)
    limit = previous.stat().st_size // 2  # any larger file write fails like a full disk

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.Popen(
        [sys.executable, "-m", "rebm.training.train", CONFIG, *FAST, "max_steps=4",
         "keep_last_states=1", f"run_dir={run_dir}"],
        cwd=REPO, env=base_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=small_files)
    code, out = finish(proc, timeout=300)
    assert code == 2, out[-4000:]
    assert "cannot write training state" in out and "Traceback" not in out
    assert _sha(previous) == digest
    assert not list((run_dir / "checkpoints").glob("*.tmp*"))


def test_a_run_never_starts_behind_the_states_of_its_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    run_train([CONFIG, *FAST, "max_steps=2"], run_dir=run_dir, timeout=300).assert_ok()
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    result = run_train([CONFIG, *FAST, "max_steps=2", "resume=never"], run_dir=run_dir,
                       timeout=300)
    assert result.returncode == 2 and "holds states of a later step" in result.output
    assert "Traceback" not in result.output
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before


def test_ctrl_c_under_torchrun_saves_and_the_same_command_resumes(straight, tmp_path):
    """A terminal's Ctrl-C: SIGINT to torchrun's process group; the agent passes it on to its
    workers (in their own sessions), which take it as a preemption."""
    run_dir = tmp_path / "run"
    args = [CONFIG, *FAST, LOG2, f"max_steps={STEPS}", "n_imgs_per_ckpt_save=100000"]
    proc = _start_torchrun(args, run_dir)
    _wait_for_records(run_dir, 1, proc)
    os.killpg(proc.pid, signal.SIGINT)
    code, out = finish(proc, timeout=60)
    assert "stopped by SIGINT" in out and f"run_dir={run_dir} to resume" in out, out[-4000:]
    assert "aborting" not in out  # the agent's copy of the same Ctrl-C is not a second one
    saved = list((run_dir / "checkpoints").glob("state_*.pt"))
    assert len(saved) == 1 and not (run_dir / "model_final.pth").exists()
    run_train(args, nproc=2, run_dir=run_dir, timeout=300).assert_ok()
    assert_states_identical(load_state(straight / "ws2", STEPS), load_state(run_dir, STEPS))
