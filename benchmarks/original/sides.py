"""Starting the two sides of the harness, each in its own process (both packages are named
`rebm`), and talking to them (common.serve's line protocol)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import List, Optional

from benchmarks.original.common import Job

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


class SideError(RuntimeError):
    pass


class SideProcess:
    """One side's worker: `request(cmd, **kw)` sends one line and returns the answer's result.
    Its stderr (the side's logs) goes to `log_path`."""

    def __init__(self, name: str, argv: List[str], env: dict, log_path: str):
        self.name, self.log_path = name, log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env,
                                     text=True, cwd=ROOT)

    def request(self, cmd: str, **kwargs):
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SideError(f"{self.name} side exited (code {self.proc.wait()}); its log "
                            f"{self.log_path} ends:\n{self.log_tail()}")
        answer = json.loads(line)
        if not answer["ok"]:
            raise SideError(f"{self.name} side: {cmd} failed: {answer['error']}\n"
                            f"{self.log_tail()}")
        return answer["result"]

    def log_tail(self, lines: int = 15) -> str:
        self.log.flush()
        with open(self.log_path) as fh:
            return "".join(fh.readlines()[-lines:])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> "SideProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _env(threads: int, pythonpath: List[str]) -> dict:
    """The worker's environment: its threads, wandb off, no rank variables, and exactly
    `pythonpath` as PYTHONPATH (the original's side must not see rebm's repository)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "PYTHONPATH")}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               WANDB_MODE="disabled", WANDB_SILENT="true", REBM_NO_PROGRESS="1",
               PYTHONUNBUFFERED="1")
    if any(pythonpath):
        env["PYTHONPATH"] = os.pathsep.join(p for p in pythonpath if p)
    return env


def start_rebm(job: Job, tag: str = "rebm", extra_env: Optional[dict] = None) -> SideProcess:
    # the caller's path after the repository's (the test suite's collective guard)
    env = _env(job.threads, [ROOT, *os.environ.get("PYTHONPATH", "").split(os.pathsep)])
    return SideProcess(tag, [os.path.join(HERE, "rebm_side.py"), job.to_json()],
                       {**env, **(extra_env or {})}, os.path.join(job.workdir, f"{tag}.log"))


def start_original(job: Job, checkout: str, extra_path: Optional[str] = None,
                   tag: str = "original") -> SideProcess:
    """The original's worker: its checkout first on the path (the script puts it there), then
    `extra_path` (where its dependencies live, when not in this interpreter's environment);
    never rebm's repository."""
    if not os.path.isfile(os.path.join(checkout, "rebm", "training", "train.py")):
        raise SideError(f"{checkout} is not a checkout of the original DAT code (no "
                        "rebm/training/train.py)")
    paths = [p for p in (extra_path or "").split(os.pathsep) if p]
    return SideProcess(tag, [os.path.join(HERE, "original_side.py"), checkout, job.to_json()],
                       _env(job.threads, paths), os.path.join(job.workdir, f"{tag}.log"))
