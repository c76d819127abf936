"""Preemption and Ctrl-C: signal handlers only set a flag; every decision to stop goes through a
consensus, so all ranks stop at the same point (docs/distributed.md, "Preemption").

- SIGTERM / SIGUSR1 (SLURM, torchrun's agent) and a first SIGINT (Ctrl-C) ask for a save at the
  next step boundary, or inside a running evaluation (its loops call `StopPoints.check_all_ranks`
  before each batch), then an exit. The evaluation entry points (`stop_on_signal`) stop the same
  way at their next batch or metric, keeping what they finished.
- A second SIGINT, at least `ECHO_WINDOW_S` after the first, aborts at once without saving. A
  launcher that passes the terminal's Ctrl-C on to its workers (torchrun's agent, the `--nproc`
  parent, srun) makes them see one Ctrl-C twice within milliseconds: that echo is not a second
  interrupt.
"""

from __future__ import annotations

import os
import signal as _signal
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional

from rebm.distributed.logs import report_to_launcher
from rebm.distributed.runtime import Runtime

ECHO_WINDOW_S = 1.0
EXIT_ABORTED = 130  # the shell's code for "killed by SIGINT"


class Preempted(Exception):
    """Raised at a stop point once every rank has agreed to stop; the training loop catches it,
    saves and exits; the evaluation entry points exit with one line."""


class PreemptionFlag:
    """Installs the handlers; `raised` says a stop was asked for on this rank. The training
    loop hands it to the loops it runs through `Runtime.preemption`."""

    SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")

    TRAINING_NOTICE = ("saving the training state at the next step, then exiting (interrupt "
                       "again to abort without saving)")
    ABORT_NOTICE = "second interrupt: aborting without saving"

    def __init__(self, notice: str = TRAINING_NOTICE) -> None:
        self.notice = notice  # what rank 0 says at the first interrupt
        self.signum: Optional[int] = None  # the first stop signal received
        self._parent = os.getppid()  # a SIGTERM after it ended is its launcher's death
        self._first_interrupt: Optional[float] = None
        self._previous: Dict[int, Any] = {}
        self._notice_prefix: Optional[str] = None  # rank 0's "[rank 0/W] "; None elsewhere

    def _handler(self, signum: int, _frame: Any) -> None:
        now = time.monotonic()
        if signum == _signal.SIGINT:
            if self._first_interrupt is not None and now - self._first_interrupt > ECHO_WINDOW_S:
                self._say(self.ABORT_NOTICE)
                report_to_launcher(self.ABORT_NOTICE)
                os._exit(EXIT_ABORTED)
            if self._first_interrupt is None:
                self._first_interrupt = now
                self._say(f"interrupt: {self.notice}")
        if self.signum is None:
            self.signum = signum

    @property
    def signal_name(self) -> Optional[str]:
        """The first stop signal's name, for people; a SIGTERM whose process has lost its
        parent since is a torchrun worker's parent-death signal (rebm.distributed.runtime), and
        says so. Asked when the run reports the stop, not in the handler: the kernel sends the
        signal before it has given the process its new parent."""
        if self.signum is None:
            return None
        name = _signal.Signals(self.signum).name
        if self.signum == _signal.SIGTERM and os.getppid() != self._parent:
            name += f" (its launcher, pid {self._parent}, ended)"
        return name

    def _say(self, text: str) -> None:
        """One line on stderr from rank 0 only (os.write: safe inside a signal handler)."""
        if self._notice_prefix is not None:
            os.write(2, f"\n{self._notice_prefix}{text}\n".encode())

    def install(self) -> "PreemptionFlag":
        # The process group's rank, not RANK: srun without torchrun sets no RANK.
        import torch.distributed as dist

        grouped = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)
        self._notice_prefix = f"[rank 0/{world}] " if rank == 0 else None
        for name in self.SIGNALS:
            if hasattr(_signal, name):
                signum = getattr(_signal, name)
                self._previous[signum] = _signal.signal(signum, self._handler)
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            _signal.signal(signum, handler)
        self._previous.clear()

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def __enter__(self) -> "PreemptionFlag":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    @property
    def raised(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by this signal (130 for SIGINT, 143 SIGTERM)."""
        return 128 + int(self.signum or _signal.SIGINT)


@contextmanager
def stop_on_signal(runtime: Runtime, notice: str) -> Iterator[Runtime]:
    """For the evaluation entry points: with the handlers installed, the runtime whose stop
    points (`stop_point_all_ranks`, `StopPoints`) raise Preempted once every rank agrees to
    stop; `notice` is what rank 0 says at the first interrupt."""
    import dataclasses

    with PreemptionFlag(notice) as flag:
        yield dataclasses.replace(runtime, preemption=flag)


def exit_stopped(runtime: Runtime, outcome: str) -> None:
    """End an evaluation entry point that every rank agreed to stop (Preempted): one line,
    rank 0's on the console (the others' in their log files), "stopped by SIGNAL: `outcome`",
    then exit with the signal's shell code."""
    import logging

    flag = runtime.preemption
    name = flag.signal_name if flag is not None and flag.signal_name else None
    line = f"stopped by {name or 'a signal on another rank'}: {outcome}"
    logging.getLogger("rebm").log(logging.WARNING if runtime.is_main else logging.INFO, "%s",
                                  line)
    report_to_launcher(line)
    raise SystemExit(flag.exit_code if flag is not None else 128 + int(_signal.SIGINT))


def should_stop_all_ranks(runtime: Runtime) -> bool:
    """Whether a stop was asked for on any rank: one consensus, so every rank must call it at
    the same point. Without an installed flag in `runtime.preemption` (an evaluation outside
    training and the entry points' `stop_on_signal`) it is False at no cost, not even a
    collective."""
    flag = runtime.preemption
    if flag is None or not flag.installed:
        return False
    from rebm.distributed.collectives import consensus

    return bool(consensus(runtime, preempt=flag.raised)["preempt"])


def stop_point_all_ranks(runtime: Runtime) -> None:
    """A point between two units of work (rows, metrics, batches) where a stop asked for on any
    rank ends the job: Preempted on every rank when `should_stop_all_ranks`."""
    if should_stop_all_ranks(runtime):
        flag = runtime.preemption
        raise Preempted(flag.signal_name or "signal")


class StopPoints:
    """The stop points of one loop over this rank's shard (an evaluation or generation loop):
    `check_all_ranks(i)` before item i. Ranks' shards may differ by a batch, so only the first
    `common` items (the fewest any rank has) are stop points: every rank reaches every one."""

    def __init__(self, runtime: Runtime, common: int):
        self.runtime, self.common = runtime, common

    def check_all_ranks(self, index: int) -> None:
        if index < self.common:
            stop_point_all_ranks(self.runtime)


def stop_points_all_ranks(runtime: Runtime, length: int) -> StopPoints:
    """The stop points of a loop over this rank's `length` items; with an installed flag on
    several ranks, one all-reduce finds the fewest items of any rank (every rank calls this)."""
    flag = runtime.preemption
    if flag is None or not flag.installed or not runtime.distributed:
        return StopPoints(runtime, length)
    import torch

    from rebm.distributed.collectives import all_reduce_min

    common = int(all_reduce_min(runtime, torch.tensor([length], dtype=torch.int64))[0])
    return StopPoints(runtime, common)


@contextmanager
def forward_signals(pids: List[int]) -> Iterator[None]:
    """In a parent that started the ranks itself (`--nproc`): pass SIGINT / SIGTERM / SIGUSR1
    on to them and keep waiting for them, instead of dying and leaving them unsaved. (A
    terminal's Ctrl-C reaches them directly too: they take the copy as its echo.)"""
    def forward(signum: int, _frame: Any) -> None:
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    previous = {}
    for name in PreemptionFlag.SIGNALS:
        if hasattr(_signal, name):
            signum = getattr(_signal, name)
            previous[signum] = _signal.signal(signum, forward)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            _signal.signal(signum, handler)
