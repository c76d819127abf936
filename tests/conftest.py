"""What the whole suite shares: runs several test files use, made once per session (each costs
tens of seconds of the 2-core machine the suite is sized for), the `slow` tier, and the order
in which the files start.

`straight`: uninterrupted 20-step DAT runs of tests.helpers' CONFIG + FAST on one process
(`ws1`) and on two with torchrun (`ws2`), a state saved at every step. The DDP-equivalence tests
compare their states; the resume, preemption and failure tests compare a stopped-and-continued
run's state at any step up to 20 with theirs (DAT's learning rate is constant, so the state at
step k does not depend on max_steps).

`slow` (left out by `make test-fast`): tests that start training runs or several processes, or
compute for several seconds, each marked `@pytest.mark.slow` where it is defined (or a whole
file by `pytestmark`); tests/test_suite_tiers.py checks that every test starting a training run
is marked.

The `_all_ranks` rule's run-time check (tests/collective_guard.py) is on in every process the
suite starts: a collective reached from a function that neither ends in `_all_ranks` nor is exempt
fails the test that was running, with the function and the stack."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile

import pytest
from filelock import FileLock

from tests import collective_guard
from tests.helpers import CONFIG, FAST, STRAIGHT_STEPS, run_train

# The files that take longest (CPU-seconds, or seconds of waiting), longest first. pytest-xdist
# (`--dist loadfile --no-loadscope-reorder`, as the Makefile runs it) hands out files in
# collection order, so starting these first keeps both workers busy to the end instead of one
# waiting while the other runs a long file last (test_train and test_table_cache would come near
# the end alphabetically). The files that read `straight` come after the first two, which leave
# it made by then.
LONGEST_FIRST = ["tests/test_resume.py", "tests/test_stage1.py", "tests/test_inception_file.py",
                 "tests/test_speed_defaults.py", "tests/test_shipped_configs.py",
                 "tests/test_eval_metrics.py", "tests/test_faults_start.py", "tests/test_faults_ranks.py",
                 "tests/test_run_dir.py", "tests/test_train.py", "tests/test_exact_sums.py",
                 "tests/test_table_cache.py", "tests/test_stage1_twin.py",
                 "tests/test_original_trajectory.py", "tests/test_imagenet_training.py",
                 "tests/test_interrupts.py", "tests/test_launcher_report.py", "tests/test_table.py",
                 "tests/test_faults.py",
                 "tests/test_faults_damage.py",
                 "tests/test_console_messages.py"]


def pytest_configure(config):
    """The collective guard for this pytest process and every process it starts (before the
    first of them: the fork server inherits this environment)."""
    os.environ[collective_guard.ENV] = tempfile.mkdtemp(prefix="rebm-collective-guard-")
    collective_guard.environment(os.environ)
    collective_guard.install_when_imported()


def pytest_unconfigure(config):
    shutil.rmtree(os.environ.pop(collective_guard.ENV, ""), ignore_errors=True)


@pytest.fixture(autouse=True)
def collectives_in_plain_sight():
    """Fail the test when a process it started (or it) reached a collective outside an
    `_all_ranks` function (docs/design.md §3)."""
    yield
    found = collective_guard.violations()
    if found:
        lines = [f"{line} [{found.count(line)} process(es)]" for line in dict.fromkeys(found)]
        pytest.fail("a collective outside an _all_ranks function (docs/design.md §3, "
                    "\"Collectives in plain sight\"):\n" + "\n".join(lines), pytrace=False)


def pytest_collection_modifyitems(items):
    rank = {path: number for number, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))


def pytest_collection_finish(session):
    """The test modules have imported torch, torchvision, timm...: about a million objects that
    every full garbage collection would walk again; freeze them (as the entry points do)."""
    gc.freeze()


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


@pytest.fixture
def one_thread():
    """The test's own computations on one torch thread (tests that compare numbers with
    another process or library); the setting is restored after it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
