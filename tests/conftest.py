"""What the whole suite shares: runs several test files use, made once per session (each costs
tens of seconds of the 2-core machine the suite is sized for), and the `slow` tier.

`straight`: uninterrupted 20-step DAT runs of tests.helpers' CONFIG + FAST on one process
(`ws1`) and on two with torchrun (`ws2`), a state saved at every step. The DDP-equivalence tests
compare their states; the resume, preemption and failure tests compare a stopped-and-continued
run's state at any step up to 20 with theirs (DAT's learning rate is constant, so the state at
step k does not depend on max_steps).

`slow` (left out by `make test-fast`): tests that start training runs or several processes. Most
files mark their own; MULTI_PROCESS_TESTS names those of files that do not (yet)."""

from __future__ import annotations

import os

import pytest
from filelock import FileLock

from tests.helpers import CONFIG, FAST, STRAIGHT_STEPS, run_train

MULTI_PROCESS_TESTS = {  # file: tests (without parameters) that spawn ranks or run an entry point
    "tests/test_eval.py": {"test_accuracy_identical_on_1_2_3_ranks",
                           "test_samples_identical_on_1_2_3_ranks",
                           "test_evaluate_entry_point_prints_json"},
    "tests/test_fid.py": {"test_fid_stats_on_2_ranks_equal_one_process_and_load_in_pytorch_fid",
                          "test_fid_with_sweep_identical_on_1_and_2_ranks"},
    "tests/test_step.py": {"test_attacks_bypass_ddp_and_ranks_stay_identical"},
    "tests/test_checkpoint_io.py": {"test_round_trip_ddp_two_processes"},
}


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        path, _, name = item.nodeid.partition("::")
        if name.split("[")[0] in MULTI_PROCESS_TESTS.get(path, ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def straight(tmp_path_factory):
    """The folder holding the reference runs `ws1` (one process) and `ws2` (two processes).
    Under pytest-xdist (`make test`) the workers share one copy: the first to need it makes it
    while holding a lock in the session's common temporary folder, the others wait and read."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = shared / "straight"
    with FileLock(str(shared / "straight.lock")):
        if not (root / "done").exists():
            for nproc in (1, 2):
                run_train([CONFIG, *FAST, f"max_steps={STRAIGHT_STEPS}"], nproc=nproc,
                          run_dir=root / f"ws{nproc}", timeout=400).assert_ok()
            (root / "done").touch()
    return root
