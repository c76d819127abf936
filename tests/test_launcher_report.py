"""What a job under torchrun prints last (docs/troubleshooting.md, "What torchrun prints after
rebm's line"). torchrun's agent always ends a failed job with its own report and a stopped one
with its own traceback, whatever the workers do; the workers make that report name rebm's line
(torchrun's error file), and nothing of rebm's comes with a traceback. For each way a job ends
early, through the real torchrun: rebm's line, then only the agent's lines (its log lines, its
traceback through torch's own code, its failure table whose Root Cause is rebm's line), and
torchrun's exit code 1, as always."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest
import torch

from rebm.distributed.logs import report_to_launcher
from tests.helpers import (
    CONFIG,
    FAST,
    REPO,
    base_env,
    finish,
    rebm_traceback_lines,
    run_train,
    start_torchrun,
    wait_for_records,
    worker_pids,
)
from tests.processes import popen

TORCH_DIR = str(Path(torch.__file__).resolve().parent)
TORCHRUN_SCRIPT = str(Path(sys.executable).parent / "torchrun")
# torch's log lines: "W1208 00:41:17.875000 3939 torch/distributed/...] ..."
AGENT_LOG_LINE = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/")
TORCHRUN_FAILED = 1  # torchrun's exit code whenever a worker failed or it was stopped
# a long run with a state only when stopped: it is training when the test stops it
LONG_RUN = [CONFIG, *FAST, "max_steps=400", "n_imgs_per_ckpt_save=100000"]


def nonempty_lines(output: str) -> list:
    return [line for line in output.splitlines() if line.strip()]


def split_at_torchruns_traceback(output: str) -> tuple:
    """(the lines before torchrun's traceback, the traceback to the end): the job prints one
    traceback, the agent's, and its frames are torch's own code."""
    lines = nonempty_lines(output)
    starts = [i for i, line in enumerate(lines) if line == "Traceback (most recent call last):"]
    assert len(starts) == 1, output[-6000:]
    before, report = lines[:starts[0]], lines[starts[0]:]
    frames = [line.strip() for line in report if line.strip().startswith('File "')]
    assert frames, output[-6000:]
    assert all(frame.startswith((f'File "{TORCH_DIR}', f'File "{TORCHRUN_SCRIPT}"'))
               for frame in frames), frames
    assert not rebm_traceback_lines(output), output[-6000:]
    return before, report


def assert_reported_as_root_cause(output: str, line: str) -> list:
    """`line` on the console once, followed by the agent's lines only: its log lines, then its
    report, whose last entry (the Root Cause) is `line`. Returns the report."""
    before, report = split_at_torchruns_traceback(output)
    assert before.count(line) == 1, output[-6000:]
    after_line = before[before.index(line) + 1:]
    assert all(AGENT_LOG_LINE.match(agent_line) for agent_line in after_line), after_line
    assert report[-1] == "=" * len(report[-1]), report
    assert report[-2] == f"  traceback : {line}", report
    return report


def the_error_line(output: str) -> str:
    errors = [line for line in nonempty_lines(output) if re.match(r"^\[rank \d+\] error: ", line)]
    assert len(errors) == 1, output[-6000:]  # one line per job
    return errors[0]


def test_the_line_left_for_the_launcher_is_what_its_report_shows(tmp_path, monkeypatch):
    """torch's own reader of a worker's error file (what the agent builds its report from)
    takes the line as the failure's message, the Root Cause of the report; without torchrun
    (no TORCHELASTIC_ERROR_FILE) nothing is written, and an unwritable file is no error."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    line = "[rank 0] error: command line: 'lr' must be > 0, got -1.0"
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    report_to_launcher(line)
    failure = ProcessFailure(local_rank=0, pid=os.getpid(), exitcode=2,
                             error_file=str(error_file))
    report = nonempty_lines(ChildFailedError("rebm.training.train", {0: failure}).format_msg())
    assert report[-2:] == [f"  traceback : {line}", "=" * len(report[-1])], report
    assert sorted(os.listdir(tmp_path)) == ["error.json"]  # no temp file left

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "absent" / "error.json"))
    report_to_launcher(line)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    report_to_launcher(line)
    assert sorted(os.listdir(tmp_path)) == ["error.json"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_config_error_is_the_root_cause_of_torchruns_report(tmp_path):
    result = run_train([CONFIG, *FAST, "max_steps=1", "lr=-1"], nproc=2, timeout=240,
                       run_dir=tmp_path / "run")
    assert result.returncode == TORCHRUN_FAILED, result.output[-6000:]
    line = the_error_line(result.output)
    assert line.startswith("[rank 0] error: command line: 'lr' must be > 0"), line
    assert_reported_as_root_cause(result.output, line)
    # torchrun's agent has no error file of its own to copy the line to, and says so
    assert "no error file defined for parent" in result.output
    assert not (tmp_path / "run").exists()


# The other entry points under torchrun, each with an error of its own kind: the same report.
OTHER_ENTRIES = {
    "evaluate": (["-m", "rebm.eval.evaluate", CONFIG, "lr=-1"], "'lr' must be > 0"),
    "table": (["-m", "rebm.eval.table", "experiments/paper/cifar10.yaml", "--checkpoints",
               "{tmp}/absent"], "--checkpoints folder '{tmp}/absent' does not exist"),
    "train_at.py": ([str(REPO / "InNOutRobustnessMean0_cifar100" / "train_at.py"),
                     "experiments/quickstart/digits_stage1.yaml", "lr=-1"], "'lr' must be > 0"),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("entry", sorted(OTHER_ENTRIES))
def test_every_entry_points_error_is_the_root_cause_of_torchruns_report(tmp_path, entry):
    args, expected = OTHER_ENTRIES[entry]
    args = [arg.format(tmp=tmp_path) for arg in args]
    cmd = [TORCHRUN_SCRIPT, "--standalone", "--nproc_per_node=2", *args,
           *(["--out", str(tmp_path / "out")] if entry == "table" else
             [f"run_dir={tmp_path / 'out'}"])]
    # the script imports rebm from this checkout, as `-m` does from the working directory
    code, out = finish(popen(cmd, base_env(1, {"PYTHONPATH": str(REPO)}), REPO), timeout=240)
    assert code == TORCHRUN_FAILED, out[-6000:]
    line = the_error_line(out)
    assert line.startswith("[rank 0] error: ") and expected.format(tmp=tmp_path) in line, line
    assert_reported_as_root_cause(out, line)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_missing_file_is_the_root_cause_and_reaches_the_agents_error_file(tmp_path):
    """With TORCHELASTIC_ERROR_FILE set for torchrun itself (a scheduler's way of reading why a
    job failed), the agent copies rebm's line there, with the worker's exit code."""
    agent_file = tmp_path / "agent_error.json"
    result = run_train([CONFIG, *FAST, "max_steps=1", f"model.ckpt_path={tmp_path}/absent.pth"],
                       nproc=2, timeout=240, run_dir=tmp_path / "run",
                       extra_env={"TORCHELASTIC_ERROR_FILE": str(agent_file)})
    assert result.returncode == TORCHRUN_FAILED, result.output[-6000:]
    line = the_error_line(result.output)
    assert f"'{tmp_path}/absent.pth' does not exist" in line, line
    assert_reported_as_root_cause(result.output, line)
    assert "no error file defined for parent" not in result.output
    copied = json.loads(agent_file.read_text())["message"]
    assert (copied["message"], copied["errorCode"]) == (line, 2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_bugs_traceback_is_printed_once_and_its_last_line_is_the_root_cause(tmp_path):
    """An uncaught error (a bug) on rank 1: the rank prints its traceback; torchrun's report
    names the error in one line instead of printing that traceback again."""
    cmd = [TORCHRUN_SCRIPT, "--standalone", "--nproc_per_node=2", "-m", "tests.bug_entry",
           CONFIG, "--bug-on-rank", "1"]
    code, out = finish(popen(cmd, base_env(1), REPO), timeout=240)
    assert code == TORCHRUN_FAILED, out[-6000:]
    lines = nonempty_lines(out)
    assert lines.count("[rank1]: ValueError: a bug on rank 1") == 1, out[-6000:]
    report = lines[lines.index("Traceback (most recent call last):"):]
    assert not [line for line in report if "bug_entry.py" in line], report
    assert report[-2] == ("  traceback : ValueError: a bug on rank 1 (the rank printed its "
                          "traceback)"), report


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_killed_mid_run_is_named_in_the_report_with_the_other_ranks_line(tmp_path):
    """Rank 1 dies (SIGKILL, as the out-of-memory killer does); rank 0 says so in one line.
    The Root Cause is torchrun's own entry for the killed rank, which has no line of its own;
    rank 0's line is the other entry of the report. (A generous --shutdown-timeout, as the
    SLURM recipe sets: torchrun stops rank 0 too, and a loaded machine may need more than its
    default 30 s before rank 0 has noticed.)"""
    run_dir = tmp_path / "run"
    proc = start_torchrun(LONG_RUN, run_dir, extra=["--shutdown-timeout=120"])
    wait_for_records(run_dir, 1, proc)
    killed = worker_pids(proc.pid)[1]
    os.kill(killed, signal.SIGKILL)
    code, out = finish(proc, timeout=200)
    assert code == TORCHRUN_FAILED, out[-6000:]
    line = the_error_line(out)
    assert line.startswith("[rank 0] error: lost the connection to another rank"), line
    _, report = split_at_torchruns_traceback(out)
    assert f"  traceback : {line}" in report, report
    # the agent sees rank 1 end first: it polls every 0.1 s, and rank 0 takes seconds to name
    # the rank it lost (a roll call through the store)
    assert report[-2] == f"  traceback : Signal 9 (SIGKILL) received by PID {killed}", report
    assert report[-1] == "=" * len(report[-1]), report


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_stopped_run_says_how_to_resume_just_before_torchruns_traceback(tmp_path, signame):
    """Ctrl-C (SIGINT to the whole process group) and SLURM's SIGTERM to the agent: the ranks
    save and rank 0 says how to resume; the agent, which got the signal too, then ends with
    its SignalException traceback (torch's frames only), and nothing else comes in between."""
    run_dir = tmp_path / "run"
    proc = start_torchrun(LONG_RUN, run_dir)
    wait_for_records(run_dir, 1, proc)
    if signame == "SIGINT":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    code, out = finish(proc, timeout=200)
    assert code == TORCHRUN_FAILED, out[-6000:]
    before, report = split_at_torchruns_traceback(out)
    assert re.search(rf"\] WARNING stopped by {signame}: state saved at step (\d+); run the "
                     rf"same command with run_dir={re.escape(str(run_dir))} to resume$",
                     before[-1]), before[-5:]
    signum = int(getattr(signal, signame))
    assert report[-1] == ("torch.distributed.elastic.multiprocessing.api.SignalException: "
                          f"Process {proc.pid} got signal: {signum}"), report
    assert len(list((run_dir / "checkpoints").glob("state_*.pt"))) == 1
