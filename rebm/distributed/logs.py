"""Rank-aware logging and whole-line stdout writes."""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from rebm.distributed.runtime import Runtime

LOGGER = logging.getLogger("rebm")


class _RankFormatter(logging.Formatter):
    def __init__(self, runtime: Runtime, with_time: bool):
        prefix = f"[rank {runtime.rank}/{runtime.world_size}] "
        fmt = ("%(asctime)s " if with_time else "") + prefix + "%(levelname)s %(message)s"
        super().__init__(fmt, datefmt="%H:%M:%S")


def setup_logging(runtime: Runtime, run_dir: Optional[str] = None) -> logging.Logger:
    """Console: rank 0 at INFO, other ranks at WARNING, prefixed [rank r/W];
    file: every rank at INFO to <run_dir>/logs/rank<r>.log."""
    logger = LOGGER
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.INFO if runtime.is_main else logging.WARNING)
    console.setFormatter(_RankFormatter(runtime, with_time=True))
    logger.addHandler(console)
    if run_dir is not None:
        log_dir = os.path.join(run_dir, "logs")
        os.makedirs(log_dir, exist_ok=True)
        file_handler = logging.FileHandler(os.path.join(log_dir, f"rank{runtime.rank}.log"))
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
