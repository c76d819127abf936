"""Exact O(1) resume, preemption and failure handling with the real entry point.

The references are the session's uninterrupted 20-step runs (`straight`, tests/conftest.py); the
runs stopped at max_steps=STOP are made once per world size and continued, or damaged, as copies.
"""

import hashlib
import os
import re
import resource
import signal
import subprocess
import sys

import pytest

from tests.helpers import (
    CONFIG,
    FAST,
    NO_ATTACKS,
    REPO,
    assert_states_identical,
    base_env,
    comparable,
    copy_run,
    finish,
    load_state,
    max_param_diff,
    read_metrics,
    run_train,
    save_state_as_step,
    start_torchrun,
    wait_for_records,
    worker_pids,
)

# generous: the first tests also wait for the shared reference and stopped runs (hangs fail
# each run's own timeout sooner)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 8
STOP = 3  # odd: the stop falls inside a metrics window (metrics every 2 steps)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """stopped(nproc): a run of world size nproc stopped at max_steps=STOP (made on first use);
    its states are those of steps 1 to STOP."""
    root = tmp_path_factory.mktemp("stopped")
    made = {}

    def get(nproc):
        if nproc not in made:
            made[nproc] = root / f"ws{nproc}"
            run_train([CONFIG, *FAST, f"max_steps={STOP}"], nproc=nproc, run_dir=made[nproc],
                      timeout=300).assert_ok()
        return made[nproc]
    return get


@pytest.fixture(scope="module")
def resumed(stopped, tmp_path_factory):
    """resumed(nproc): (run dir, output) of a copy of stopped(nproc) continued to STEPS by the
    same command (made on first use)."""
    root = tmp_path_factory.mktemp("resumed")
    made = {}

    def get(nproc):
        if nproc not in made:
            run_dir = copy_run(stopped(nproc), root / f"ws{nproc}")
            result = run_train([CONFIG, *FAST, f"max_steps={STEPS}"], nproc=nproc,
                               run_dir=run_dir, timeout=300).assert_ok()
            made[nproc] = run_dir, result.output
        return made[nproc]
    return get


def records_to(run_dir, step):
    return comparable([r for r in read_metrics(run_dir) if r["step"] <= step])


@pytest.mark.bridge
@pytest.mark.numbers
@pytest.mark.parametrize("nproc", [1, 2])
def test_stop_and_resume_is_bit_identical(straight, resumed, nproc):
    run_dir, output = resumed(nproc)
    assert f"at step {STOP}" in output  # it resumed rather than restarted
    assert_states_identical(load_state(straight / f"ws{nproc}", STEPS), load_state(run_dir, STEPS))
    assert comparable(read_metrics(run_dir)) == records_to(straight / f"ws{nproc}", STEPS)


def test_the_same_command_on_a_finished_run_does_nothing(resumed, tmp_path):
    run_dir = copy_run(resumed(1)[0], tmp_path / "run")
    final = (run_dir / "model_final.pth").read_bytes()
    result = run_train([CONFIG, *FAST, f"max_steps={STEPS}"], run_dir=run_dir,
                       timeout=300).assert_ok()
    # it names the limit that ended the run (digits: 1438 images, 44 steps an epoch at 32)
    assert (f"nothing to do: the run is already at step {STEPS}, where max_steps: {STEPS} ends "
            "it; total_epochs: 10 (44 steps an epoch) ends it later; raise max_steps to continue "
            "it") in result.output, result.output
    assert (run_dir / "model_final.pth").read_bytes() == final
    assert not list((run_dir / "checkpoints").glob(f"state_{STEPS + 1:09d}.pt"))


def test_a_run_ended_by_total_epochs_continues_with_a_larger_total_epochs(tmp_path):
    """The README's promise on the quickstart config, which sets total_epochs: a larger max_steps
    alone does nothing (a run stops at the first of the two) and the line says so; a larger
    total_epochs continues the run from its state."""
    run_dir = tmp_path / "run"
    epochs = [CONFIG, *FAST, *NO_ATTACKS, "batch_size=719"]  # 1438 images: 2 steps an epoch
    run_train([*epochs, "total_epochs=1"], run_dir=run_dir, timeout=300).assert_ok()
    final = (run_dir / "model_final.pth").read_bytes()
    rerun = run_train([*epochs, "total_epochs=1", "max_steps=100"], run_dir=run_dir,
                      timeout=300).assert_ok()
    assert ("nothing to do: the run is already at step 2, where total_epochs: 1 (2 steps an "
            "epoch) ends it; max_steps: 100 ends it later; raise total_epochs to continue it"
            ) in rerun.output, rerun.output
    assert (run_dir / "model_final.pth").read_bytes() == final
    longer = run_train([*epochs, "total_epochs=2"], run_dir=run_dir, timeout=300).assert_ok()
    assert "at step 2" in longer.output and "nothing to do" not in longer.output, longer.output
    assert [r["step"] for r in read_metrics(run_dir)][-1] == 4
    assert (run_dir / "checkpoints" / f"state_{4:09d}.pt").exists()


def test_resume_does_not_need_the_pretrained_checkpoint_any_more(stopped, tmp_path):
    """The state holds the weights: a resumed run must not read model.ckpt_path (on a cluster
    the stage-1 file may have been moved or deleted since the run started)."""
    missing = tmp_path / "pretrained.pth"
    args = [CONFIG, *FAST, f"model.ckpt_path={missing}"]
    run_dir = copy_run(stopped(1), tmp_path / "run")
    result = run_train([*args, f"max_steps={STOP + 1}"], run_dir=run_dir,
                       timeout=300).assert_ok()
    assert f"at step {STOP}" in result.output and "loaded checkpoint" not in result.output
    # a fresh run with the missing file fails clearly
    fresh = run_train([*args, "max_steps=1"], run_dir=tmp_path / "fresh", timeout=300)
    assert fresh.returncode == 2 and str(missing) in fresh.output


def test_resume_on_a_different_world_size(straight, stopped, tmp_path):
    run_dir = copy_run(stopped(2), tmp_path / "run")
    run_train([CONFIG, *FAST, f"max_steps={STEPS}"], nproc=1, run_dir=run_dir,
              timeout=300).assert_ok()
    a, b = load_state(straight / "ws2", STEPS), load_state(run_dir, STEPS)
    assert max_param_diff(a["model"], b["model"]) <= 1e-4


def _startup_seconds(run_dir):
    text = (run_dir / "logs" / "rank0.log").read_text()
    return float(re.findall(r"first batch after ([0-9.]+)s", text)[-1])


def test_resume_cost_does_not_grow_with_the_step(straight, resumed, tmp_path):
    """Start-up (to the first batch) of a resume at step 2000 against one at step STOP."""
    run_dir = tmp_path / "at2000"
    save_state_as_step(load_state(straight / "ws1", STEPS), run_dir, 2000)
    # model.compile pinned off: a run planning 2001 steps would compile (auto), which is not
    # the data position's cost this test measures
    run_train([CONFIG, *FAST, "max_steps=2001", "total_epochs=null", "model.compile=false"],
              run_dir=run_dir, timeout=300).assert_ok()
    seconds = {step: _startup_seconds(folder)
               for step, folder in ((STOP, resumed(1)[0]), (2000, run_dir))}
    assert abs(seconds[2000] - seconds[STOP]) < 1.0, seconds


def test_sigterm_to_one_rank_saves_and_same_command_resumes(straight, tmp_path):
    run_dir = tmp_path / "run"
    args = [CONFIG, *FAST, f"max_steps={STEPS}", "n_imgs_per_ckpt_save=100000"]
    proc = start_torchrun(args, run_dir)
    wait_for_records(run_dir, 1, proc)
    os.kill(worker_pids(proc.pid)[1], signal.SIGTERM)
    code, out = finish(proc, timeout=30)
    assert code == 0, out[-4000:]
    assert f"run the same command with run_dir={run_dir} to resume" in out
    assert list((run_dir / "checkpoints").glob("state_*.pt"))
    run_train(args, nproc=2, run_dir=run_dir, timeout=300).assert_ok()
    assert_states_identical(load_state(straight / "ws2", STEPS), load_state(run_dir, STEPS))


def test_sigkill_of_a_worker_ends_the_job_and_max_restarts_resumes(tmp_path):
    args = [CONFIG, *FAST, "max_steps=30"]
    proc = start_torchrun(args, tmp_path / "plain")
    wait_for_records(tmp_path / "plain", 1, proc)  # metrics every 2 steps: at step 2
    os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
    code, out = finish(proc, timeout=60)
    assert code != 0

    run_dir = tmp_path / "elastic"
    proc = start_torchrun([CONFIG, *FAST, "max_steps=12"], run_dir, extra=["--max-restarts=1"])
    wait_for_records(run_dir, 2, proc)  # step 4
    os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
    code, out = finish(proc, timeout=300)
    assert code == 0, out[-4000:]
    assert "resumed from" in (run_dir / "logs" / "rank0.log").read_text()
    assert load_state(run_dir, 12)["step"] == 12


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_corrupt_newest_state_falls_back_to_previous(stopped, tmp_path):
    run_dir = copy_run(stopped(1), tmp_path / "run")
    newest = run_dir / "checkpoints" / f"state_{STOP:09d}.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, like a crash mid-copy
    result = run_train([CONFIG, *FAST, f"max_steps={STOP + 1}"], run_dir=run_dir,
                       timeout=300).assert_ok()
    assert newest.name in result.output and "unreadable" in result.output
    assert f"at step {STOP - 1}" in result.output
    assert load_state(run_dir, STOP + 1)["step"] == STOP + 1


def test_failing_state_write_is_a_clear_error_and_keeps_previous(stopped, tmp_path):
    run_dir = copy_run(stopped(1), tmp_path / "run")
    previous = run_dir / "checkpoints" / f"state_{STOP:09d}.pt"
    digest = _sha(previous)
    limit = previous.stat().st_size // 2  # any larger file write fails like a full disk

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.Popen(
        [sys.executable, "-m", "rebm.training.train", CONFIG, *FAST, f"max_steps={STOP + 2}",
         "keep_last_states=1", f"run_dir={run_dir}"],
        cwd=REPO, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=small_files)
    code, out = finish(proc, timeout=300)
    assert code == 2, out[-4000:]
    assert "cannot write training state" in out and "Traceback" not in out
    assert _sha(previous) == digest
    assert not list((run_dir / "checkpoints").glob("*.tmp*"))


def test_a_run_never_starts_behind_the_states_of_its_run_dir(stopped, tmp_path):
    run_dir = copy_run(stopped(1), tmp_path / "run")
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    result = run_train([CONFIG, *FAST, f"max_steps={STOP}", "resume=never"], run_dir=run_dir,
                       timeout=300)
    assert result.returncode == 2 and "holds states of a later step" in result.output
    assert "Traceback" not in result.output
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before


def test_ctrl_c_under_torchrun_saves_and_the_same_command_resumes(straight, tmp_path):
    """A terminal's Ctrl-C: SIGINT to torchrun's process group; the agent passes it on to its
    workers (in their own sessions), which take it as a preemption."""
    run_dir = tmp_path / "run"
    args = [CONFIG, *FAST, f"max_steps={STEPS}", "n_imgs_per_ckpt_save=100000"]
    proc = start_torchrun(args, run_dir)
    wait_for_records(run_dir, 1, proc)
    os.killpg(proc.pid, signal.SIGINT)
    code, out = finish(proc, timeout=60)
    assert "stopped by SIGINT" in out and f"run_dir={run_dir} to resume" in out, out[-4000:]
    assert "aborting" not in out  # the agent's copy of the same Ctrl-C is not a second one
    saved = list((run_dir / "checkpoints").glob("state_*.pt"))
    assert len(saved) == 1 and not (run_dir / "model_final.pth").exists()
    run_train(args, nproc=2, run_dir=run_dir, timeout=300).assert_ok()
    assert_states_identical(load_state(straight / "ws2", STEPS), load_state(run_dir, STEPS))
