"""Runs several test files share, made once per session (each costs tens of seconds of the
2-core machine the suite is sized for).

`straight`: uninterrupted 20-step DAT runs of tests.helpers' CONFIG + FAST on one process
(`ws1`) and on two with torchrun (`ws2`), a state saved at every step. The DDP-equivalence tests
compare their states; the resume, preemption and failure tests compare a stopped-and-continued
run's state at any step up to 20 with theirs (DAT's learning rate is constant, so the state at
step k does not depend on max_steps)."""

from __future__ import annotations

import pytest

from tests.helpers import CONFIG, FAST, STRAIGHT_STEPS, run_train


@pytest.fixture(scope="session")
def straight(tmp_path_factory):
    """The folder holding the reference runs `ws1` (one process) and `ws2` (two processes)."""
    root = tmp_path_factory.mktemp("straight")
    for nproc in (1, 2):
        run_train([CONFIG, *FAST, f"max_steps={STRAIGHT_STEPS}"], nproc=nproc,
                  run_dir=root / f"ws{nproc}", timeout=400).assert_ok()
    return root
