"""Rank-aware logging, whole-line stdout writes, and the line a rank leaves for its launcher."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import traceback
from typing import Iterable, Optional

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from rebm.disk import room_for
from rebm.distributed.runtime import Runtime
from rebm.errors import UserError

LOGGER = logging.getLogger("rebm")


class LogFileError(UserError, OSError):
    """The rank's log file cannot be created (read-only or full run directory)."""


class _RankFormatter(logging.Formatter):
    def __init__(self, runtime: Runtime, with_time: bool):
        prefix = f"[rank {runtime.rank}/{runtime.world_size}] "
        fmt = ("%(asctime)s " if with_time else "") + prefix + "%(levelname)s %(message)s"
        super().__init__(fmt, datefmt="%H:%M:%S")


class _ConsoleHandler(logging.StreamHandler):
    """Console lines through tqdm.write, so a log line never lands on a progress bar's line
    (tqdm clears the bars, writes the line, redraws them)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # never let logging kill the run
            self.handleError(record)


class _RankFileHandler(logging.FileHandler):
    """This rank's log file. A write it cannot make (a full disk, a file-size limit) is one
    warning on the console naming the file and the free space, once; the file is then closed
    and the run goes on logging to the console alone (its saves report their own failures),
    instead of logging's "--- Logging error ---" block at every line."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if not isinstance(err, OSError) or self.failed:
            super().handleError(record)
            return
        self.failed = True
        try:
            self.close()  # flushes what is buffered: fails the same way
        except OSError:
            pass
        LOGGER.warning("cannot write the log file '%s' (%s; %s): logging to the console only "
                       "from now on (free disk space, or raise the file-size limit: ulimit -f)",
                       self.baseFilename, err.strerror or err, room_for(self.baseFilename))


def log_to_file(message: str, exc_info: Optional[BaseException] = None) -> None:
    """Write to this rank's log file only (the console has its own report of the error)."""
    for handler in LOGGER.handlers:
        if isinstance(handler, logging.FileHandler):
            record = LOGGER.makeRecord(LOGGER.name, logging.ERROR, __file__, 0, message, (),
                                       (type(exc_info), exc_info, exc_info.__traceback__)
                                       if exc_info is not None else None)
            handler.handle(record)


def report_to_launcher(line: str) -> None:
    """Leave `line`, the one this rank ends with, where torchrun's agent looks for why a worker
    failed: the file it names in TORCHELASTIC_ERROR_FILE, in the format torch's `record` writes.
    The agent's failure report then shows the line as the rank's `traceback` (the Root Cause,
    when this rank failed first) instead of "To enable traceback see: ...", and an agent given
    an error file of its own copies the line there with the exit code. No such variable (no
    torchrun): nothing to do. Written whole (a temp file, then a rename): the agent reads the
    file when the rank has ended, and a half-written one would end the agent with a traceback
    of its own; a file that cannot be written costs nothing, as the console has the line."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # `record`'s layout (a message with extraInfo), not the bare string torch also reads: for
    # that one the agent prints two warnings. The timestamp (whole seconds, as `record` writes
    # it) decides which failure is the Root Cause: the earliest.
    report = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}
    temp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temp, "w") as fh:
            json.dump(report, fh)
        os.replace(temp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(temp)


class SummaryErrorHandler(ErrorHandler):
    """torch's `record` handler for rebm's workers: an uncaught error (a bug) goes into
    torchrun's error file as its first line only (`ValueError: ...`). The worker prints the
    whole traceback itself; torch's own handler would have the agent's report print it again."""

    def record_exception(self, e: BaseException) -> None:
        summary = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()[0]
        report_to_launcher(f"{summary} (the rank printed its traceback)")


def setup_logging(runtime: Runtime, log_file: Optional[str] = None,
                  elsewhere: str = "run_dir=PATH") -> logging.Logger:
    """Console: rank 0 at INFO, other ranks at WARNING, prefixed [rank r/W];
    file: every rank at INFO to `log_file`, this rank's (a run's <run_dir>/logs/rank<r>.log:
    RunDirectory.log_file). `elsewhere` is how the user names another folder (a table's
    --out DIR), for the line when the log file cannot be written."""
    logger = LOGGER
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    console = _ConsoleHandler(sys.stderr)
    console.setLevel(logging.INFO if runtime.is_main else logging.WARNING)
    console.setFormatter(_RankFormatter(runtime, with_time=True))
    logger.addHandler(console)
    if log_file is not None:
        log_dir = os.path.dirname(log_file)
        try:
            os.makedirs(log_dir, exist_ok=True)
            file_handler = _RankFileHandler(log_file)
        except OSError as err:
            raise LogFileError(f"cannot write the log file in '{log_dir}' ({err.strerror or err});"
                               f" choose a writable {elsewhere}") from None
        file_handler.setLevel(logging.INFO)
        file_handler.setFormatter(_RankFormatter(runtime, with_time=True))
        logger.addHandler(file_handler)
    return logger


def print_line(text: str) -> None:
    """Write one whole line to stdout in a single write. Ranks share the launcher's stdout, and
    print() under PYTHONUNBUFFERED writes the text and its newline separately, so two ranks'
    lines could run together ("...okrank 0/4 ...")."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def progress_enabled(stream=None) -> bool:
    """Progress bars: REBM_PROGRESS=1 forces them on, REBM_PROGRESS=0 (or the older
    REBM_NO_PROGRESS=1) off; by default on only when the bar's stream (stderr) is a terminal,
    so the logs of batch jobs get no bar lines."""
    forced = os.environ.get("REBM_PROGRESS")
    if forced in ("0", "1"):
        return forced == "1"
    if os.environ.get("REBM_NO_PROGRESS") == "1":
        return False
    return (stream or sys.stderr).isatty()


def progress(iterable: Iterable, runtime: Runtime, desc: str, total: int) -> Iterable:
    """`iterable` with a tqdm bar on rank 0 when bars are on, else as it is. Pure: no
    collective, no stop (the loops call their stop points themselves: rebm.distributed.signals
    `StopPoints`)."""
    if not runtime.is_main or not progress_enabled():
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True,
                mininterval=1.0)
