"""The run directory: chosen on rank 0, shared with every rank, and held by one job at a time.

Rank 0 holds an exclusive lock (`<run_dir>/.lock`, flock) for the whole run; the kernel releases
it when the process ends, however it ends. A second job on the same run dir stops at start-up
with one line naming the holder, before it writes anything.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import socket
import time
from typing import Optional, Tuple

from rebm.config import TrainConfig, freeze
from rebm.distributed import Runtime, decide_on_main
from rebm.errors import UserError

LOCK_NAME = ".lock"
LOGGER = logging.getLogger("rebm")


class RunDirError(UserError, OSError):
    """The run directory cannot be created, or another job holds it."""


class RunDirLock:
    """An exclusive flock on <run_dir>/.lock; the file says who holds it."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK_NAME)
        try:
            self._file = open(self.path, "a+")
        except OSError as err:
            raise RunDirError(f"cannot write '{self.path}' ({err.strerror}); choose a writable "
                              "run_dir=PATH") from None
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                # e.g. Lustre mounted without flock: run, but unguarded
                LOGGER.warning("run_dir %s: this filesystem does not support file locks (%s); "
                               "nothing stops a second job on the same run_dir", run_dir,
                               err.strerror)
                return
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self._file.close()
            raise RunDirError(
                f"run_dir '{run_dir}' is in use by {holder}; wait for that job to end, or "
                "choose another run_dir=PATH") from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                         f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()


def resolve_run_dir(cfg: TrainConfig, runtime: Runtime
                    ) -> Tuple[TrainConfig, Optional[RunDirLock]]:
    """Rank 0 creates and locks the run directory, every rank gets its absolute path; returns
    the config with that `run_dir` and the lock (rank 0) or None. Every rank calls this."""
    held = []

    def choose() -> str:
        chosen = os.path.abspath(cfg.run_dir or os.path.join("runs", "run"))
        try:
            os.makedirs(chosen, exist_ok=True)
        except OSError as err:
            raise RunDirError(f"cannot create run_dir '{chosen}' ({err.strerror}); choose a "
                              "writable run_dir=PATH") from None
        held.append(RunDirLock(chosen))
        return chosen

    chosen = decide_on_main(runtime, choose)
    cfg = freeze(dataclasses.replace(cfg, run_dir=chosen), cfg._explicit_keys)
    return cfg, (held[0] if held else None)
