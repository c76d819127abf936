"""Start-up faults (issue 48 points 8, 9 and the log handler of point 2), with real processes:
a resume never changes what a run trains without a word; a log file that cannot be written is
one line, and the run goes on; ranks that never join, a taken MASTER_PORT and a stopped rank are
one line each within a stated time; workers die with their torchrun agent."""

from __future__ import annotations

import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from rebm.checkpoint.state import read_state
from rebm.checkpoint.weights import atomic_torch_save
from tests.helpers import (
    CONFIG,
    FAST,
    NO_ATTACKS,
    REPO,
    base_env,
    error_lines,
    finish,
    process_alive,
    rebm_traceback_lines,
    run_train,
    start_torchrun,
    state_path,
    wait_for_records,
    wait_for_workers,
)
from tests.processes import popen

pytestmark = [pytest.mark.timeout(400)]

QUICK = [CONFIG, *FAST, *NO_ATTACKS, "robust_eval=false", "n_imgs_per_metrics_log=32"]


def _forget_key(run_dir: Path, key: str) -> None:
    """Make the run look written before `key` existed: its state's config and its config.yaml
    lack the key (the state rewritten by rebm's own writer)."""
    path = str(state_path(run_dir, 1))
    state = read_state(path)
    del state["config"][key]
    atomic_torch_save(state, path)
    config_file = run_dir / "config.yaml"
    saved = yaml.safe_load(config_file.read_text())
    del saved[key]
    config_file.write_text(yaml.safe_dump(saved))


@pytest.mark.slow
def test_a_key_an_older_run_lacks_compares_as_its_default(tmp_path):
    old = tmp_path / "digits"
    run_train([*QUICK, "max_steps=1"], run_dir=old).assert_ok()
    _forget_key(old, "r1reg")
    assert "r1reg" not in torch.load(state_path(old, 1), weights_only=True)["config"]

    # The new key at another value than the default: the old run trained without it.
    refused = run_train([*QUICK, "max_steps=2", "r1reg=0.01"], run_dir=old)
    assert refused.returncode == 2, refused.output[-3000:]
    errors = error_lines(refused.output)
    assert len(errors) == 1, refused.output[-3000:]
    assert "r1reg: unset (the default 0.0) -> 0.01" in errors[0]
    assert "resume=force" in errors[0]
    assert not state_path(old, 2).exists()

    # A new run of the same config beside it: its start-up line says how they differ, under the
    # same rule (the old run's config.yaml lacks the key too).
    beside = tmp_path / "digits-0123abcd"
    new = run_train([*QUICK, "max_steps=1", "r1reg=0.01"], run_dir=beside).assert_ok()
    notice = [line for line in new.output.splitlines() if "new run in" in line]
    assert len(notice) == 1, new.output[-3000:]
    assert "differs in r1reg: unset (the default 0.0) -> 0.01" in notice[0], notice
    assert "same training keys" not in new.output

    # At its default the old run continues.
    resumed = run_train([*QUICK, "max_steps=2"], run_dir=old).assert_ok()
    assert state_path(old, 2).exists(), resumed.output[-3000:]
    assert re.search(r"resum\w* .*step 1", resumed.output), resumed.output[-3000:]


@pytest.mark.slow
def test_a_log_file_that_cannot_be_written_is_one_line_and_the_run_goes_on(tmp_path):
    """A job requeued onto its own log file, which has reached the file-size limit
    (RLIMIT_FSIZE, as `ulimit -f` sets it): every append to it fails with EFBIG, while the run's
    other files, all smaller, are written."""
    run_dir = tmp_path / "run"
    log_file = run_dir / "logs" / "rank0.log"
    log_file.parent.mkdir(parents=True)
    limit = 64 * 2**20
    with open(log_file, "wb") as fh:
        fh.truncate(limit)  # sparse: no disk space used

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd = [sys.executable, "-m", "rebm.training.train", *QUICK, "max_steps=2",
           f"run_dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=limit_file_size,
                            start_new_session=True)
    code, output = finish(proc, timeout=240)
    assert code == 0, output[-4000:]
    assert "Logging error" not in output, output[-4000:]
    warnings = [line for line in output.splitlines() if "cannot write the log file" in line]
    assert len(warnings) == 1, output[-4000:]
    assert f"'{log_file}' (File too large;" in warnings[0]
    # in the unit of every other message about room (rebm/disk.py), and the limit that hit
    assert re.search(r"; [\d.]+ (bytes|[KMGT]iB) free on its filesystem, file-size limit 64.0 "
                     r"MiB \(ulimit -f\)\)", warnings[0]), warnings[0]
    assert "logging to the console only from now on" in warnings[0]
    # the run went on: it logged to the console after the warning and finished its files
    after = output.split(warnings[0], 1)[1]
    assert "step 2/2" in after, output[-4000:]
    assert (run_dir / "model_final.pth").exists()
    assert os.path.getsize(log_file) == limit  # the file itself is as it was


# --------------------------------------------------------------------------------------------
# Start-up faults: each is one line per rank that meets it, within a bound the config sets.
# --------------------------------------------------------------------------------------------
JOIN_S = 5  # ddp_timeout_s of these runs: the ranks wait this long for each other


def _launched_rank(rank: int, port: int, args, world: int = 2):
    """A rank started the way srun or a hand-written script starts one: RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT in its environment, no torchrun."""
    env = base_env(extra=dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                              LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port)))
    return popen([sys.executable, "-m", "rebm.training.train", *args], env, REPO)



def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_a_rank_that_never_joins_is_named_within_the_join_timeout(tmp_path):
    # two jobs of 2 ranks: rank 0 alone (its rank 1 never starts), and rank 1 alone
    ports = [_free_port(), _free_port()]
    alone = [_launched_rank(rank, ports[rank], [*QUICK, "max_steps=1", f"ddp_timeout_s={JOIN_S}",
                                                f"run_dir={tmp_path / f'run{rank}'}"])
             for rank in range(2)]
    (code0, output0), (code1, output1) = (finish(proc, timeout=120) for proc in alone)
    for code, output in ((code0, output0), (code1, output1)):
        assert code == 2 and len(error_lines(output)) == 1, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    assert (f"[rank 0/2] waiting for rank(s) 1 to join at 127.0.0.1:{ports[0]} (giving up after "
            f"{JOIN_S} s)") in output0
    error0 = error_lines(output0)[0]
    assert f"[rank 0] error: rank 1 of 2 did not join within {JOIN_S} s" in error0
    assert f"waited at 127.0.0.1:{ports[0]}" in error0 and "MASTER_PORT" in error0
    error1 = error_lines(output1)[0]
    assert (f"[rank 1] error: rank 1 on {socket.gethostname()} found nothing serving the "
            f"rendezvous at 127.0.0.1:{ports[1]}") in error1
    assert "rank 0 did not start or failed" in error1


@pytest.mark.slow
def test_a_taken_master_port_is_one_line_on_every_rank(tmp_path):
    # another program listens on MASTER_PORT (it accepts connections and never answers)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(8)
        port = taken.getsockname()[1]
        args = [*QUICK, "max_steps=1", f"ddp_timeout_s={JOIN_S}", f"run_dir={tmp_path / 'run'}"]
        ranks = [_launched_rank(rank, port, args) for rank in range(2)]
        results = [finish(proc, timeout=120) for proc in ranks]
    for rank, (code, output) in enumerate(results):
        assert code == 2, output[-3000:]
        errors = error_lines(output)
        assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
        assert errors[0].startswith(f"[rank {rank}] error: rank {rank} on "), errors
        assert f"another program holds MASTER_PORT={port}" in errors[0], errors
    assert "(address already in use)" in error_lines(results[0][1])[0]




STEPS = [*QUICK, "max_steps=100000", "total_epochs=null", "n_imgs_per_ckpt_save=100000",
         "model.compile=false"]


@pytest.mark.slow
def test_a_stopped_rank_is_named_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    agent = start_torchrun([*STEPS, "ddp_step_timeout_s=10", "ddp_timeout_s=60"], run_dir)
    pids = {}
    try:
        pids = wait_for_workers(agent)
        wait_for_records(run_dir, 2, agent)
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.time()
        while process_alive(pids[0]) and time.time() < stopped + 90:
            time.sleep(0.2)
        named_after = time.time() - stopped
        # torchrun's agent sends the stopped rank a SIGTERM it cannot act on, and SIGKILL 30 s
        # later: that SIGKILL, sooner
        os.kill(pids[1], signal.SIGKILL)
        code, output = finish(agent, timeout=60)
    finally:
        for pid in pids.values():
            if process_alive(pid):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    assert code != 0
    named = [line for line in error_lines(output) if "did not arrive" in line]
    assert len(named) == 1, output[-4000:]
    assert re.match(r"\[rank 0\] error: collective timed out at step \d+ on rank 0: rank 1 did "
                    r"not arrive", named[0]), named
    assert rebm_traceback_lines(output) == [], output[-4000:]
    # the step timeout, the 10 s in which the live ranks check in, then the exit (slow on a
    # busy machine); the start-up timeout (ddp_timeout_s=60) would take longer
    assert named_after < 10 + 10 + 25, named_after


@pytest.mark.slow
def test_workers_die_with_their_torchrun_agent(tmp_path):
    """`kill -9` of torchrun alone: its workers (each in a session of its own) get SIGTERM from
    the kernel, save a state and exit, instead of training on with nobody to collect them."""
    run_dir = tmp_path / "run"
    agent = start_torchrun(STEPS, run_dir)
    pids = {}
    try:
        pids = wait_for_workers(agent)
        wait_for_records(run_dir, 2, agent)
        os.kill(agent.pid, signal.SIGKILL)
        killed = time.time()
        while any(process_alive(pid) for pid in pids.values()) and time.time() < killed + 60:
            time.sleep(0.2)
        survivors = [rank for rank, pid in pids.items() if process_alive(pid)]
    finally:
        for pid in pids.values():
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
    output = agent.communicate(timeout=30)[0]
    assert survivors == [], f"ranks {survivors} outlived their agent\n{output[-3000:]}"
    stopped = re.findall(r"\[rank 0/2\] WARNING stopped by SIGTERM \(its launcher, pid (\d+), "
                         r"ended\): state saved at step \d+; run the same command with "
                         r"run_dir=\S+ to resume", output)
    assert stopped == [str(agent.pid)], output[-3000:]
    assert list((run_dir / "checkpoints").glob("state_*.pt"))


@pytest.mark.slow
def test_a_table_whose_out_folder_is_a_file_says_to_choose_another_out(tmp_path):
    """The table's output folder is named with --out (it has no run_dir): the line that its log
    file cannot be written names the option the user can change."""
    from tests.test_table_cache import _run, _table, _write_checkpoint

    ckpts = tmp_path / "ckpts"
    _write_checkpoint(ckpts / "a.pth", seed=0)
    out = tmp_path / "out"
    out.write_text("a file where the table's folder would go")
    result = _run(_table(tmp_path, "t", ["accuracy"], ["a"]), ckpts, out)
    assert result.returncode != 0, result.output[-4000:]
    errors = error_lines(result.output)
    assert len(errors) == 1, result.output[-4000:]
    assert f"cannot write the log file in '{out / 'logs'}' (Not a directory)" in errors[0], errors
    assert errors[0].endswith("choose a writable --out DIR"), errors
    assert not rebm_traceback_lines(result.output)
    assert out.read_text() == "a file where the table's folder would go"


@pytest.mark.slow
def test_an_evaluation_whose_run_dir_is_a_file_says_so(tmp_path):
    """`rebm.eval.evaluate run_dir=FILE`: one line saying the output folder is a file (not
    makedirs' "File exists" about a lock file inside it), with what to do; the file is kept."""
    from tests.test_table_cache import _write_checkpoint

    ckpt = tmp_path / "m.pth"
    _write_checkpoint(ckpt, seed=0)
    out = tmp_path / "out"
    out.write_text("not a folder")
    result = run_train([CONFIG, f"model.ckpt_path={ckpt}", "robust_eval_steps=1",
                        "eval.num_images=8", f"run_dir={out}"], module="rebm.eval.evaluate")
    assert result.returncode != 0, result.output[-4000:]
    errors = error_lines(result.output)
    assert len(errors) == 1, result.output[-4000:]
    assert f"'{out}' is a file, not a directory; choose a writable output folder with " \
        "run_dir=PATH" in errors[0], errors
    assert not rebm_traceback_lines(result.output) and out.read_text() == "not a folder"
