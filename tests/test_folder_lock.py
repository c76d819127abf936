"""The one folder lock (rebm/checkpoint/folder_lock.py) under both its names: a run directory's
`.lock` (RunDirLock) and an evaluation's `.eval.lock` (OutputFolderLock), held and contested by
real processes (forked from this one: cheap, and each holds its own flock) on real files."""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import socket

import pytest

from rebm.checkpoint.run_directory import RunDirError, RunDirLock
from rebm.eval.files import EvalFolderBusy, OutputFolderLock

FORK = multiprocessing.get_context("fork")
LOCKS = {"run_dir": (RunDirLock, ".lock"), "eval": (OutputFolderLock, ".eval.lock")}


def _lock(kind: str, folder: str):
    return RunDirLock(folder) if kind == "run_dir" else OutputFolderLock(folder, "--out DIR")


def _busy_line(kind: str, folder: str, holder: str) -> str:
    if kind == "run_dir":
        return (f"run_dir '{folder}' is in use by {holder}; wait for that job to end, or choose "
                "another run_dir=PATH")
    return (f"output folder '{folder}' is in use by another evaluation ({holder}); wait for it "
            "to end, or write elsewhere with --out DIR")


def _hold(kind: str, folder: str, ready, fsize_limit=None) -> None:
    """A child: take the lock (under a file-size limit, if given), say so, and keep it."""
    if fsize_limit is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
    try:
        held = _lock(kind, folder)
    except (RunDirError, EvalFolderBusy) as err:
        ready.send(f"{type(err).__name__}: {err}")
        os._exit(0)
    ready.send("locked")
    signal.pause()
    held.release()


def _start_holder(kind: str, folder: str, fsize_limit=None):
    here, there = FORK.Pipe()
    proc = FORK.Process(target=_hold, args=(kind, folder, there, fsize_limit))
    proc.start()
    assert here.poll(30), "the holder did not answer"
    return proc, here.recv()


def _kill(proc) -> None:
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)


@pytest.mark.parametrize("kind", sorted(LOCKS))
def test_a_held_folder_is_one_line_naming_its_holder_until_the_holder_dies(tmp_path, kind):
    folder = str(tmp_path / "run")
    lock_class, lock_name = LOCKS[kind]
    other = "eval" if kind == "run_dir" else "run_dir"
    holder, said = _start_holder(kind, folder)
    try:
        assert said == "locked"
        written = (tmp_path / "run" / lock_name).read_text().strip()
        assert written.startswith(f"pid {holder.pid} on {socket.gethostname()} since ")
        with pytest.raises(lock_class.FAILURE) as refused:
            _lock(kind, folder)
        assert str(refused.value) == _busy_line(kind, folder, written)
        # the other lock of the same folder is another file: an evaluation of a run's
        # checkpoints in its run directory does not stop the run, nor the run the evaluation
        _lock(other, folder).release()
    finally:
        _kill(holder)
    assert holder.exitcode == -signal.SIGKILL
    taken = _lock(kind, folder)  # the kernel released the killed holder's lock
    assert (tmp_path / "run" / lock_name).read_text().startswith(f"pid {os.getpid()} on ")
    taken.release()
    assert sorted(os.listdir(folder)) == sorted([lock_name, LOCKS[other][1]])


@pytest.mark.parametrize("kind", sorted(LOCKS))
def test_a_lock_that_cannot_be_created_is_one_line_with_the_free_space(tmp_path, kind):
    (tmp_path / "a_file").write_text("in the way\n")
    folder = str(tmp_path / "a_file" / "run")
    lock_class, lock_name = LOCKS[kind]
    with pytest.raises(lock_class.FAILURE) as refused:
        _lock(kind, folder)
    advice = ("choose a writable run_dir=PATH" if kind == "run_dir" else
              "choose a writable output folder with --out DIR")
    line = str(refused.value)
    assert line.startswith(f"cannot write '{os.path.join(folder, lock_name)}' (Not a directory; ")
    assert "free on its filesystem" in line and line.endswith(f"); {advice}") and "\n" not in line
    assert (tmp_path / "a_file").read_text() == "in the way\n"


def test_a_holder_whose_name_does_not_fit_on_the_disk(tmp_path):
    """Under a 16-byte file-size limit the holder's line cannot be written. A run directory is
    then refused in one line (its run could write nothing either) and left unlocked; an
    evaluation keeps its lock without the name, and the next one is told 'another process'."""
    folder = str(tmp_path / "run")
    holder, said = _start_holder("run_dir", folder, fsize_limit=16)
    _kill(holder)
    assert said.startswith(f"RunDirError: cannot write '{os.path.join(folder, '.lock')}' (File "
                           "too large; "), said
    assert "free on its filesystem, file-size limit 16 bytes (ulimit -f)" in said, said
    assert said.endswith("); free disk space, or choose a run_dir on another filesystem"), said
    RunDirLock(folder).release()  # the refused holder left it free

    holder, said = _start_holder("eval", folder, fsize_limit=16)
    try:
        assert said == "locked"
        with pytest.raises(EvalFolderBusy) as refused:
            _lock("eval", folder)
        assert str(refused.value) == _busy_line("eval", folder, "another process")
    finally:
        _kill(holder)
