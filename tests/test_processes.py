"""tests/processes.py forks the entry points from a preloaded server instead of starting new
interpreters. A forked run must be indistinguishable from `python -m` / `python FILE` in what
the tests read: states, console lines, exit codes, signals, atexit handlers."""

import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers import (
    CONFIG,
    FAST,
    REPO,
    assert_states_identical,
    base_env,
    finish,
    load_state,
)
from tests.processes import ForkedProcess, popen

SCRIPT = textwrap.dedent("""
    import atexit, sys, time
    atexit.register(lambda: print("atexit ran", flush=True))
    print("argv", sys.argv[1:], flush=True)
    what = sys.argv[1]
    if what == "raise":
        raise RuntimeError("boom")
    if what == "exit-text":
        sys.exit("a message")
    if what == "sleep":
        time.sleep(60)
    sys.exit(int(what))
""")


def _both(cmd, env=None):
    """(forked, fresh): each (exit code, output) of cmd."""
    env = env or base_env(1)
    forked = popen(cmd, env, REPO)
    assert isinstance(forked, ForkedProcess)
    fresh = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return finish(forked, 120), finish(fresh, 120)


def _without_times(output: str) -> list:
    lines = [re.sub(r"^\d\d:\d\d:\d\d ", "", line) for line in output.splitlines()]
    return [re.sub(r"\d+(\.\d+)?s\b|imgs_per_s \S+|max_rss_mib \S+", "#", line)
            for line in lines]


@pytest.mark.parametrize("what, code", [("0", 0), ("3", 3), ("raise", 1), ("exit-text", 1)])
def test_exit_codes_output_and_atexit_are_the_interpreters(tmp_path, what, code):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    forked, fresh = _both([sys.executable, str(script), what])
    assert forked[0] == fresh[0] == code
    assert "atexit ran" in forked[1] and f"argv ['{what}']" in forked[1]
    assert forked[1] == fresh[1]  # tracebacks included


def test_an_unhandled_ctrl_c_kills_it_by_the_signal(tmp_path):
    """From a process that does not ignore SIGINT (as a terminal's shell): both die of it."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_both(script)
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_both(script):
    procs = [popen([sys.executable, str(script), "sleep"], base_env(1), REPO),
             subprocess.Popen([sys.executable, str(script), "sleep"], cwd=REPO,
                              env=base_env(1), stdout=subprocess.PIPE, text=True,
                              stderr=subprocess.STDOUT, start_new_session=True)]
    time.sleep(1.5)  # both are sleeping
    for proc in procs:
        proc.send_signal(signal.SIGINT)
    results = [finish(proc, 30) for proc in procs]
    assert [code for code, _ in results] == [-signal.SIGINT, -signal.SIGINT]
    assert all("KeyboardInterrupt" in out for _, out in results)


def test_a_bad_override_is_the_same_one_line(tmp_path):
    forked, fresh = _both([sys.executable, "-m", "rebm.training.train", CONFIG, "lr=fast",
                           f"run_dir={tmp_path}"])
    assert forked == fresh and forked[0] == 2


@pytest.mark.slow
def test_a_forked_run_writes_what_python_m_writes(tmp_path):
    runs = {}
    for name in ("forked", "fresh"):
        cmd = [sys.executable, "-m", "rebm.training.train", CONFIG, *FAST, "max_steps=2",
               f"run_dir={tmp_path / 'run'}"]
        env = base_env()
        if name == "forked":
            proc = popen(cmd, env, REPO)
        else:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        code, out = finish(proc, 240)
        assert code == 0, out[-3000:]
        runs[name] = load_state(tmp_path / "run", 2), _without_times(out)
        (tmp_path / "run").rename(tmp_path / name)
    assert_states_identical(runs["forked"][0], runs["fresh"][0])
    assert runs["forked"][1] == runs["fresh"][1]
