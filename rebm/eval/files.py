"""How evaluation writes its results files and owns its output folder.

- `write_replacing(path, write)`: every results file (eval.json, the table's files and cache,
  sample grids, reliability diagrams, sample PNGs) is written to a temporary file of this
  process's own name beside it, then renamed over `path`: a reader sees the previous file or the
  new one, never a part of one. A write that fails (full disk, a file-size limit) removes its
  temporary file, leaves the previous file as it was, and raises OSError naming `path` (its strerror names the
  file too: the one-line messages quote only the strerror).
- `OutputFolderLock`: an evaluation holds an exclusive lock (flock) on `<folder>/.eval.lock` of
  its output folder for as long as it runs (`rebm.eval.evaluate` on its run_dir, a table on its
  --out folder); a second evaluation into the same folder stops at start-up with one line naming
  the holder, before it writes anything. The kernel releases the
  lock when the process ends, however it ends.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from typing import Callable

from rebm.checkpoint.run_directory import RunDirectory
from rebm.errors import UserError

LOGGER = logging.getLogger("rebm")


def temporary_name(path: str) -> str:
    """The temporary file `path` is written to: hidden, beside it, named by this process."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{os.getpid()}.tmp")


def write_replacing(path: str, write: Callable[[str], None]) -> str:
    """`write(temporary path)`, then the temporary file renamed over `path` (module docstring);
    returns `path`. On failure nothing of it is left and the previous `path` is unchanged."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = temporary_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as err:
        remove_quietly(tmp)
        raise OSError(err.errno, f"{err.strerror or err}, writing {os.path.basename(path)}",
                      path) from None
    except BaseException:
        remove_quietly(tmp)
        raise
    return path


def write_text_replacing(path: str, text: str) -> str:
    def write(tmp: str) -> None:
        with open(tmp, "w", newline="") as fh:
            fh.write(text)

    return write_replacing(path, write)


def remove_quietly(path: str) -> None:
    """Remove `path` if it is there (cleaning up after a failed write: its own error counts)."""
    try:
        os.remove(path)
    except OSError:
        pass


class EvalFolderBusy(UserError, OSError):
    """Another evaluation is writing into the same output folder."""


class OutputFolderLock:
    """An exclusive flock on `<folder>/.eval.lock` (module docstring); the file names the
    holder. Taken by rank 0 only; `release()` at the end, or the process's exit."""

    def __init__(self, folder: str, elsewhere: str = "run_dir=PATH"):
        self.path = RunDirectory(folder).eval_lock_file
        try:
            os.makedirs(folder, exist_ok=True)
            self._file = open(self.path, "a+")
        except OSError as err:
            raise EvalFolderBusy(f"cannot write '{self.path}' ({err.strerror or err}); choose "
                                 f"a writable output folder with {elsewhere}") from None
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                LOGGER.warning("%s: this filesystem does not support file locks (%s); nothing "
                               "stops a second evaluation into the same folder", folder,
                               err.strerror)
                return
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self._file.close()
            raise EvalFolderBusy(
                f"output folder '{folder}' is in use by another evaluation ({holder}); wait "
                f"for it to end, or write elsewhere with {elsewhere}") from None
        self._say_holder()

    def _say_holder(self) -> None:
        """Who holds the lock, in its file (for the line of the evaluation it stops). The lock
        holds without it: a full disk costs only the name."""
        try:
            self._file.seek(0)
            self._file.truncate()
            self._file.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                             f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            self._file.flush()
        except OSError:
            pass

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
