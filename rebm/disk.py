"""What a failed write of a run's file says: why, and how much room there was (the free space of
the file's filesystem, and the process's file-size limit when one is set), in one line. Shared by
the state and model writers (rebm/checkpoint/weights.py), the folder locks
(rebm/checkpoint/folder_lock.py) and rank 0's writes for people (`on_main`,
rebm/distributed/collectives.py): just above the floor of the layers, so that all may import it.
Importing this module imports no torch."""

from __future__ import annotations

import os
import re
import resource
import shutil

from rebm.errors import UserError


def _size(count: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"  # not reached


def room_for(path: str) -> str:
    """'12.3 GiB free on its filesystem' for the file `path` (its nearest existing folder),
    plus ', file-size limit 1.0 MiB (ulimit -f)' when the process has one."""
    folder = os.path.dirname(os.path.abspath(path))
    while folder and not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        free = f"{_size(shutil.disk_usage(folder).free)} free on its filesystem"
    except OSError:
        free = "free space unknown"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        free += f", file-size limit {_size(limit)} (ulimit -f)"
    return free


def reason(err: BaseException) -> str:
    """The first line of an error, short: an OSError's strerror ('No space left on device'),
    torch.save's own RuntimeError ('... unexpected pos 1234 vs 1184')."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    text = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", text)  # torch's C++ check
    if text.startswith("unexpected pos"):  # torch.save's writer: fewer bytes written than asked
        text = f"a short write: {text}"
    return text if len(text) <= 120 else text[:117] + "..."


class WriteError(UserError, OSError):
    """A run's file could not be written (full disk, file-size limit, permissions). Its
    `strerror` says why and how much room there was; str() names the file too."""

    def __init__(self, path: str, err: BaseException):
        super().__init__()
        self.errno = getattr(err, "errno", None)
        self.strerror = f"{reason(err)}; {room_for(path)}"
        self.filename = path

    def __str__(self) -> str:
        return f"cannot write '{self.filename}' ({self.strerror})"


def write_failure(err: BaseException) -> str:
    """Why a write failed and, when the error names its file, how much room there was
    ('File too large; 1.2 GiB free on its filesystem, file-size limit 200 bytes (ulimit -f)').
    A WriteError says both already; an error that names no file (a write into a file already
    open) says why only."""
    if isinstance(err, WriteError):
        return err.strerror
    filename = getattr(err, "filename", None)
    if isinstance(filename, (str, os.PathLike)):
        return f"{reason(err)}; {room_for(os.fspath(filename))}"
    return reason(err)
