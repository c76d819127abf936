"""Preemption signals: handlers only set a flag; the loop passes it through a consensus."""

from __future__ import annotations

import signal as _signal
from typing import Any, Optional


class PreemptionFlag:
    """SIGTERM/SIGUSR1 (SLURM preemption) only set a flag; the training loop passes it through
    `consensus` at the next step so all ranks save and exit together."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self) -> None:
        self.signal_name: Optional[str] = None

    def _handler(self, signum: int, _frame: Any) -> None:
        self.signal_name = _signal.Signals(signum).name

    def install(self) -> "PreemptionFlag":
        for name in self.SIGNALS:
            if hasattr(_signal, name):
                _signal.signal(getattr(_signal, name), self._handler)
        return self

    @property
    def raised(self) -> bool:
        return self.signal_name is not None
