"""An exclusive lock on a folder that names its holder: the run directory's `.lock`
(rebm.checkpoint.run_directory.RunDirLock) and an evaluation's `.eval.lock`
(rebm.eval.files.OutputFolderLock).

The lock is a flock(2) on one file in the folder, taken without waiting; its holder then writes
into that file who holds it ("pid 4242 on node1 since 2026-01-02 10:00:00"), which the job it
stops quotes in its one line. The kernel releases the lock when the process ends, however it
ends, so a lock file left behind is harmless. On a filesystem without file locks (Lustre mounted
without flock) the holder goes on unguarded, with a warning. A subclass words its lines: it knows
what the folder is and what the user can do. Importing this module imports no torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import time
from abc import ABC, abstractmethod
from typing import ClassVar, Optional, Type

from rebm.disk import reason, room_for

LOGGER = logging.getLogger("rebm")


class FolderLock(ABC):
    """An exclusive flock on the file `path` (its folder is created if missing); the file names
    the holder. `release()` at the end, or the process's exit. Every failure is one line: a
    `FAILURE` (the subclass's exception class) in the subclass's words."""

    FAILURE: ClassVar[Type[Exception]]

    def __init__(self, path: str):
        self.path = path
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a+")
        except FileExistsError:  # makedirs met a file in the folder's place ("File exists")
            raise self.FAILURE(f"'{os.path.dirname(os.path.abspath(path))}' is a file, not a "
                               f"directory; {self.if_unwritable()}") from None
        except OSError as err:
            raise self.FAILURE(self._cannot_write(err, self.if_unwritable())) from None
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                LOGGER.warning("%s: this filesystem does not support file locks (%s); nothing "
                               "stops %s", self.where(), err.strerror, self.unguarded())
                return
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self._file.close()
            raise self.FAILURE(self.busy(holder)) from None
        try:
            self._name_holder()
        except OSError as err:  # a full disk, a file-size limit
            advice = self.if_holder_unwritten()
            if advice is not None:
                self._abandon()
                raise self.FAILURE(self._cannot_write(err, advice)) from None

    # What a subclass says -----------------------------------------------------------------
    @abstractmethod
    def where(self) -> str:
        """The folder, for the warning of a filesystem without file locks."""

    @abstractmethod
    def unguarded(self) -> str:
        """What nothing stops on such a filesystem, e.g. 'a second job on the same run_dir'."""

    @abstractmethod
    def busy(self, holder: str) -> str:
        """The line for a folder another process holds; `holder` is what its lock file says."""

    @abstractmethod
    def if_unwritable(self) -> str:
        """What to do when the lock file cannot be created."""

    def if_holder_unwritten(self) -> Optional[str]:
        """What to do when the holder's name cannot be written (a full disk); None: go on, the
        lock holds without the name (the job it stops then says 'another process')."""
        return None

    # ---------------------------------------------------------------------------------------
    def _name_holder(self) -> None:
        """This process's line in the lock file, or (on failure) an empty file: a part of the
        line could name another process ('pid 12' of pid 1234). Written unbuffered, so that
        nothing of a failed line stays behind to be flushed later."""
        fd = self._file.fileno()
        os.ftruncate(fd, 0)
        line = (f"pid {os.getpid()} on {socket.gethostname()} since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n").encode()
        try:
            while line:  # a write that meets the limit writes what fits; the next one fails
                line = line[os.write(fd, line):]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            raise

    def _cannot_write(self, err: OSError, advice: str) -> str:
        return f"cannot write '{self.path}' ({reason(err)}; {room_for(self.path)}); {advice}"

    def _abandon(self) -> None:
        """Unlock and close after a failed write (closing flushes, and may fail again)."""
        fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
        try:
            self._file.close()
        except OSError:
            pass

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
