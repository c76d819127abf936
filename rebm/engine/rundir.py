"""The run directory: chosen on rank 0, shared with every rank, and held by one job at a time.

Rank 0 holds an exclusive lock (`<run_dir>/.lock`, flock) for the whole run; the kernel releases
it when the process ends, however it ends. A second job on the same run dir stops at start-up
with one line naming the holder, before it writes anything.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import logging
import os
import secrets
import socket
import time
from typing import Optional, Tuple

import yaml

from rebm.checkpoint.paths import RUN_CONFIG, sibling_runs
from rebm.config import TrainConfig, replace, to_dict, training_diff
from rebm.distributed import Runtime, decide_on_main, setup_logging
from rebm.distributed.collectives import on_every_rank
from rebm.errors import UserError

LOCK_NAME = ".lock"
SHARED_CHECK_NAME = ".shared_check"  # rank 0's token: the other ranks must read it back
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


def remove_stale_temp_files(run_dir: str) -> None:
    """Temp files of writes a killed job never finished (`atomic_torch_save`, metrics rewrite).
    Only the lock holder calls this, so no live writer owns them."""
    for pattern in ("*.tmp", os.path.join("checkpoints", "*.tmp")):
        for path in glob.glob(os.path.join(run_dir, pattern)) + glob.glob(
                os.path.join(run_dir, os.path.dirname(pattern), ".*.tmp")):
            try:
                os.remove(path)
                LOGGER.info("removed %s, left by an interrupted write", path)
            except OSError:
                pass


def check_shared(run_dir: str, token: str, runtime: Runtime) -> None:
    """Every rank must see the file rank 0 just wrote: run_dir has to be on a filesystem all
    nodes share (states, model files and the resume decision live there)."""
    try:
        with open(os.path.join(run_dir, SHARED_CHECK_NAME)) as fh:
            seen = fh.read().strip()
    except OSError:
        seen = None
    if seen != token:
        raise RunDirError(
            f"run_dir '{run_dir}' as seen from rank {runtime.rank} on {socket.gethostname()} is "
            "not the directory rank 0 created: put run_dir on a filesystem shared by all nodes")


def _saved_config(run_dir: str) -> dict:
    try:
        with open(os.path.join(run_dir, RUN_CONFIG)) as fh:
            return yaml.safe_load(fh) or {}
    except (OSError, yaml.YAMLError):
        return {}


def new_run_notice(cfg: TrainConfig) -> Optional[str]:
    """For a new run directory beside runs of the same config (`<name>` and `<name>-<hash>`:
    the command line changed training keys, so the default run_dir changed): one line naming
    the nearest of them and the keys that differ. None when there is none."""
    siblings = sibling_runs(cfg.run_dir)
    if not siblings:
        return None
    current = to_dict(cfg)
    diffs = {path: training_diff(_saved_config(path), current) for path in siblings}
    nearest = min(siblings, key=lambda path: len(diffs[path]))
    others = f" (and {len(siblings) - 1} other run(s) of this config)" if len(siblings) > 1 else ""
    if diffs[nearest]:
        return (f"new run in {cfg.run_dir}: the existing run {nearest}{others} differs in "
                f"{'; '.join(diffs[nearest])} (run_dir={nearest} resume=force would continue "
                "that one instead)")
    return (f"new run in {cfg.run_dir}: the existing run {nearest}{others} has the same "
            f"training keys (run_dir={nearest} continues that one instead)")


def resolve_run_dir_all_ranks(cfg: TrainConfig, runtime: Runtime
                              ) -> Tuple[TrainConfig, Optional[RunDirLock]]:
    """Rank 0 creates and locks the run directory, every rank gets its absolute path and checks
    that it sees the same directory; returns the config with that `run_dir` and the lock (rank
    0) or None. Every rank calls this."""
    held = []
    setup_logging(runtime)  # the console, for the lines below (the run's log file comes next)

    def choose() -> Tuple[str, str]:
        chosen = os.path.abspath(cfg.run_dir or os.path.join("runs", "run"))
        notice = None if os.path.exists(os.path.join(chosen, RUN_CONFIG)) else (
            cfg.run_dir and new_run_notice(cfg))
        if notice:
            LOGGER.info("%s", notice)
        try:
            os.makedirs(chosen, exist_ok=True)
        except OSError as err:
            raise RunDirError(f"cannot create run_dir '{chosen}' ({err.strerror}); choose a "
                              "writable run_dir=PATH") from None
        held.append(RunDirLock(chosen))
        remove_stale_temp_files(chosen)
        token = secrets.token_hex(8)
        with open(os.path.join(chosen, SHARED_CHECK_NAME), "w") as fh:
            fh.write(token + "\n")
        return chosen, token

    chosen, token = decide_on_main(runtime, choose, "create the run directory")
    on_every_rank(runtime, lambda: check_shared(chosen, token, runtime), "see the run directory")
    cfg = replace(cfg, run_dir=chosen)
    return cfg, (held[0] if held else None)
