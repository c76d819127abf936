"""Run the real entry points in real processes, with a hard timeout so a hang fails the test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@dataclass
class RunResult:
    returncode: int
    output: str
    run_dir: Optional[Path]

    def assert_ok(self) -> "RunResult":
        assert self.returncode == 0, f"exit {self.returncode}\n{self.output[-6000:]}"
        return self


def base_env(threads: int = 1, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def finish(proc: subprocess.Popen, timeout: float) -> tuple:
    """(exit code, output) of a process started with start_new_session=True; if it has not
    exited within `timeout`, kill its whole process group and fail the test (a hang)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"did not exit within {timeout}s (a hang?): {proc.args}\n{out[-6000:]}")
    return proc.returncode, out


def run_command(cmd: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None,
                run_dir: Optional[Path] = None) -> RunResult:
    """Run cmd in its own process group; on timeout kill the whole group and fail."""
    proc = subprocess.Popen(
        list(cmd), cwd=REPO, env=env or base_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    return RunResult(*finish(proc, timeout), run_dir)


def torchrun_cmd(module: str, args: Sequence[str], nproc: int) -> list:
    return [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}",
            "-m", module, *args]


def run_train(args: Sequence[str], nproc: int = 1, timeout: float = 240,
              run_dir: Optional[Path] = None, threads: Optional[int] = None,
              module: str = "rebm.training.train", extra_env=None) -> RunResult:
    """The real entry point: `python -m` for one process, `torchrun --standalone` for several."""
    args = list(args) + ([f"run_dir={run_dir}"] if run_dir is not None else [])
    if nproc == 1:
        cmd = [sys.executable, "-m", module, *args]
    else:
        cmd = torchrun_cmd(module, args, nproc)
    env = base_env(threads if threads is not None else max(1, 2 // nproc), extra_env)
    return run_command(cmd, timeout, env, run_dir)


def rebm_traceback_lines(output: str) -> list:
    """Traceback frames in rebm's own code (torchrun prints its own traceback whenever a worker
    exits non-zero; the workers themselves must print one line)."""
    prefix = f'File "{REPO / "rebm"}'
    return [line for line in output.splitlines() if line.strip().startswith(prefix)]
