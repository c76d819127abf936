"""No damaged file becomes a number, and no progress is thrown away: bit flips in weights files,
training states and the table cache, states set aside as damaged, a state the run cannot read,
and the temp files and config.yaml of interrupted writes, through the real entry points in real
processes (tests/test_faults_ckpt.py has the earlier faults of states and weights files)."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import socket
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from rebm.checkpoint.integrity import archive_damage
from rebm.checkpoint.run_directory import RunDirectory
from rebm.checkpoint.weights import CheckpointError, read_checkpoint
from tests.helpers import (
    BIN,
    CONFIG,
    FAST,
    REPO,
    base_env,
    comparable,
    copy_run,
    finish,
    read_metrics,
    rebm_traceback_lines,
    run_command,
    run_train,
    state_path,
)
from tests.test_faults_ckpt import error_lines, flip_a_bit_in_tensor_data

pytestmark = pytest.mark.timeout(600)

STAGE2 = "experiments/quickstart/digits_stage2.yaml"


@pytest.fixture(scope="module")
def three_states(tmp_path_factory):
    """A finished 3-step DAT run (one process) with a state at every step."""
    run_dir = tmp_path_factory.mktemp("three") / "run"
    run_train([CONFIG, *FAST, "max_steps=3"], run_dir=run_dir, timeout=300).assert_ok()
    return run_dir


def central_entry(path: Path, record: int = 0) -> int:
    """The offset of the `record`-th entry of the zip archive's central directory."""
    data = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        offset = archive.start_dir
    for _ in range(record):
        names, extra, comment = struct.unpack("<HHH", data[offset + 28:offset + 34])
        offset += 46 + names + extra + comment
    assert data[offset:offset + 4] == b"PK\x01\x02"
    return offset


def flip(path: Path, offset: int, mask: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------------------------
# 1. Weights files are verified like training states: one check, one line
# --------------------------------------------------------------------------------------------
def _weights(tmp_path: Path) -> Path:
    path = tmp_path / "w.pth"
    torch.manual_seed(0)
    torch.save({"fc.weight": torch.randn(17, 33), "fc.bias": torch.randn(17)}, path)
    return path


def _flip_exponent(path: Path) -> None:
    """The top exponent bit of a float in the middle of the largest record: a huge number."""
    with zipfile.ZipFile(path) as archive:
        record = max(archive.infolist(), key=lambda info: info.file_size)
    data = path.read_bytes()
    names, extra = struct.unpack("<HH", data[record.header_offset + 26:record.header_offset + 30])
    start = record.header_offset + 30 + names + extra
    flip(path, start + (record.file_size // 2 // 4) * 4 + 3, 0x40)


def _flip_method(to: int):
    """The compression method of the first record in the central directory: 0 (stored) ->
    `to` (1: unsupported, NotImplementedError; 8: deflate, zlib.error)."""
    def damage(path: Path) -> None:
        flip(path, central_entry(path) + 10, to)
    return damage


def _flip_name_as_utf8(path: Path) -> None:
    """A high bit of the first record's name in the central directory, marked UTF-8 (torch
    marks it; else the flag is set too): UnicodeDecodeError in zipfile."""
    entry = central_entry(path)
    if not path.read_bytes()[entry + 9] & 0x08:  # general purpose flag bit 11: UTF-8 names
        flip(path, entry + 9, 0x08)
    flip(path, entry + 46, 0x80)


@pytest.mark.parametrize("damage, says", [
    (lambda p: flip_a_bit_in_tensor_data(p), "the CRC-32 of its record '"),
    (_flip_exponent, "the CRC-32 of its record '"),
    (_flip_method(1), "its zip metadata is damaged (NotImplementedError"),
    (_flip_method(8), "its zip metadata is damaged ("),
    (_flip_name_as_utf8, "its zip metadata is damaged (UnicodeDecodeError"),
], ids=["tensor-bit", "exponent-bit", "method-unsupported", "method-deflate", "name-utf8"])
def test_any_damage_to_a_weights_file_is_one_error_naming_it(tmp_path, damage, says):
    path = _weights(tmp_path)
    assert archive_damage(str(path)) is None
    read_checkpoint(str(path))
    damage(path)
    assert says in (archive_damage(str(path)) or "")
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(str(path))
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"checkpoint '{path}' is damaged: {says}")


def test_a_file_that_cannot_be_read_is_an_os_error_not_damage(tmp_path):
    folder = tmp_path / "state_000000001.pt"
    folder.mkdir()
    with pytest.raises(OSError):
        archive_damage(str(folder))


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["evaluate", "stage2"])
def test_a_flipped_weights_file_stops_evaluation_and_stage_2_in_one_line(three_states, tmp_path,
                                                                         entry):
    """`python -m rebm.eval.evaluate` of a run's model_final.pth, and a stage-2 run whose
    model.ckpt_path is a training state, each with one flipped bit in its tensor data."""
    source = (three_states / "model_final.pth" if entry == "evaluate"
              else state_path(three_states, 3))
    damaged = tmp_path / source.name
    shutil.copy(source, damaged)
    record = flip_a_bit_in_tensor_data(damaged)
    before = damaged.read_bytes()
    module, config = (("rebm.eval.evaluate", CONFIG) if entry == "evaluate"
                      else ("rebm.training.train", STAGE2))
    result = run_command([sys.executable, "-m", module, config, f"model.ckpt_path={damaged}",
                          "robust_eval_steps=1", "max_steps=1", f"run_dir={tmp_path / 'run'}"],
                         timeout=240)
    assert result.returncode == 2, result.output[-4000:]
    errors = error_lines(result.output)
    assert len(errors) == 1, result.output[-4000:]
    assert (f"checkpoint '{damaged}' is damaged: the CRC-32 of its record '{record}' does not "
            "match its data") in errors[0]
    assert "Traceback" not in result.output and damaged.read_bytes() == before


# --------------------------------------------------------------------------------------------
# 3. States set aside as damaged keep the run from starting afresh behind them
# 5. Damaged zip metadata of a state is damage like any other
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_set_aside_states_stop_a_rerun_and_a_restart_until_resume_never(three_states, tmp_path):
    run_dir = copy_run(three_states, tmp_path / "run")
    flip_a_bit_in_tensor_data(state_path(run_dir, 3))
    flip(state_path(run_dir, 2), central_entry(state_path(run_dir, 2)) + 10, 1)  # metadata
    flip_a_bit_in_tensor_data(state_path(run_dir, 1))
    args = [CONFIG, *FAST, "max_steps=4", f"run_dir={run_dir}"]
    # torchrun restarts the workers once after the first attempt stopped on the damaged states
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "-m", "rebm.training.train", *args]
    first = run_command(cmd, timeout=300)
    assert first.returncode != 0, first.output[-5000:]
    assert "none of the 3 training states" in first.output, first.output[-5000:]
    assert "its zip metadata is damaged (NotImplementedError" in first.output
    refused = [line for line in error_lines(first.output) if "set aside as damaged" in line]
    assert refused, first.output[-5000:]  # the restart
    assert "resumed from" not in first.output and "step 1/" not in first.output
    aside = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert aside == [state_path(run_dir, s).name + ".unusable" for s in (1, 2, 3)], aside
    assert not rebm_traceback_lines(first.output)

    rerun = run_command([sys.executable, "-m", "rebm.training.train", *args], timeout=240)
    assert rerun.returncode == 2, rerun.output[-4000:]
    errors = error_lines(rerun.output)
    assert len(errors) == 1 and "holds only training states set aside as damaged (" \
        f"{aside[2]}, {aside[1]}, {aside[0]})" in errors[0] and "resume=never" in errors[0], errors
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == aside

    afresh = run_train([CONFIG, *FAST, "max_steps=1", "resume=never"], run_dir=run_dir)
    afresh.assert_ok()
    assert "resumed from" not in afresh.output
    left = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert left == [state_path(run_dir, 1).name, *aside], left


# --------------------------------------------------------------------------------------------
# 4. A state the run cannot read stops it; it is not set aside
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_state_that_cannot_be_read_stops_every_rank_and_is_kept(three_states, tmp_path):
    """The newest state is a folder (IsADirectoryError: the operating system's, as a permission
    or an I/O error would be; root reads any file whatever its mode): the run stops on both
    ranks in one line naming it; nothing is renamed, the older state is not resumed from."""
    run_dir = copy_run(three_states, tmp_path / "run")
    newest = state_path(run_dir, 3)
    newest.unlink()
    newest.mkdir()
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    result = run_train([CONFIG, *FAST, "max_steps=4"], nproc=2, run_dir=run_dir)
    assert result.returncode != 0, result.output[-4000:]
    errors = error_lines(result.output)
    assert len(errors) == 1, result.output[-4000:]
    assert f"training state '{newest}' cannot be read (Is a directory)" in errors[0], errors
    assert "resumed from" not in result.output and not rebm_traceback_lines(result.output)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before


@pytest.mark.slow
def test_a_resume_from_state_that_does_not_exist_is_a_wrong_path_not_an_unreadable_file(tmp_path):
    """A mistyped resume_from_state is one line saying the path does not exist, not the advice
    for a file the run cannot read ("make it readable"), which would send the user after
    permissions; nothing is written into the run directory but its logs."""
    missing = tmp_path / "elsewhere" / "state_000000003.pt"
    run_dir = tmp_path / "run"
    result = run_train([CONFIG, *FAST, "max_steps=2", f"resume_from_state={missing}"],
                       run_dir=run_dir)
    assert result.returncode != 0, result.output[-4000:]
    errors = error_lines(result.output)
    assert len(errors) == 1, result.output[-4000:]
    assert f"training state '{missing}' does not exist; check the path" in errors[0], errors
    assert "make it readable" not in result.output and not rebm_traceback_lines(result.output)
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())


@pytest.mark.slow
def test_damaged_lines_in_metrics_jsonl_are_dropped_when_the_run_continues(three_states, straight,
                                                                          tmp_path):
    """Lines of metrics.jsonl that are no record (bytes that are not UTF-8, JSON that is not an
    object, a step that is not a number) are dropped by the continued run as a line cut short
    by a crash is, instead of a traceback: its records then equal an uninterrupted run's."""
    run_dir = copy_run(three_states, tmp_path / "run")
    with open(run_dir / "metrics.jsonl", "ab") as fh:
        fh.write(b"\xff\xfe not text\n[1, 2]\n{\"step\": \"x\"}\n")
    result = run_train([CONFIG, *FAST, "max_steps=4", "resume=force"], run_dir=run_dir,
                       timeout=300)
    result.assert_ok()
    assert not rebm_traceback_lines(result.output)
    records = comparable(read_metrics(run_dir))
    straight_records = [r for r in comparable(read_metrics(straight / "ws1")) if r["step"] <= 4]
    assert records == straight_records


# --------------------------------------------------------------------------------------------
# Smaller: config.yaml under a file-size limit, temp files of killed writers, a dangling link
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_config_yaml_under_a_file_size_limit_is_left_whole(three_states, tmp_path):
    run_dir = copy_run(three_states, tmp_path / "run")
    shutil.rmtree(run_dir / "logs")  # the log files start below the limit
    config = (run_dir / "config.yaml").read_bytes()
    limit = 1024
    assert len(config) > limit

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.Popen(
        [sys.executable, "-m", "rebm.training.train", CONFIG, *FAST, "max_steps=4",
         f"run_dir={run_dir}"], cwd=REPO, env=base_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, preexec_fn=small_files, start_new_session=True)
    code, out = finish(proc, timeout=300)
    assert code == 2, out[-4000:]
    errors = error_lines(out)
    assert len(errors) == 1 and "config.yaml" in errors[0], out[-4000:]
    assert (run_dir / "config.yaml").read_bytes() == config
    assert not [name for name in os.listdir(run_dir) if name.endswith(".tmp")]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_each_cleanup_removes_only_temp_files_whose_writer_is_gone(tmp_path):
    """Training's (the run directory's holder) removes its own writers' temp files and those of
    gone processes; evaluation's (the evaluation folder's holder) only those of gone processes:
    a live process's temp file is in flight, whoever wrote it."""
    host, dead, live = socket.gethostname(), _dead_pid(), os.getppid()
    (tmp_path / "samples").mkdir()
    (tmp_path / "checkpoints").mkdir()
    training_own = [tmp_path / ".model_final.pth.1a2b3c4d.save.tmp",
                    tmp_path / "checkpoints" / ".state_000000004.pt.x1y2.tmp"]
    gone = [tmp_path / f".eval.json.{dead}@{host}.tmp",
            tmp_path / "samples" / f".seed_samples.png.{dead}.tmp"]
    in_flight = [tmp_path / f".eval.json.{live}@{host}.tmp",
                 tmp_path / f".config.yaml.{dead}@another-host.tmp"]
    for path in training_own + gone + in_flight:
        path.write_bytes(b"partial")
    RunDirectory(str(tmp_path)).remove_stale_evaluation_temp_files()
    assert [p.exists() for p in training_own + gone + in_flight] == [True] * 2 + [False] * 2 + \
        [True] * 2
    RunDirectory(str(tmp_path)).remove_stale_temp_files()
    assert [p.exists() for p in training_own + in_flight] == [False] * 2 + [True] * 2


@pytest.mark.slow
def test_an_evaluation_removes_the_temp_files_of_a_killed_one(three_states, tmp_path):
    run_dir = copy_run(three_states, tmp_path / "run")
    dead, live, host = _dead_pid(), os.getpid(), socket.gethostname()
    stale = [run_dir / "samples" / f".seed_samples.png.{dead}.tmp",
             run_dir / f".eval.json.{dead}@{host}.tmp"]
    kept = run_dir / "samples" / f".gen_samples.png.{live}@{host}.tmp"
    (run_dir / "samples").mkdir(exist_ok=True)
    for path in [*stale, kept]:
        path.write_bytes(b"partial")
    result = run_command([sys.executable, "-m", "rebm.eval.evaluate", CONFIG,
                          f"model.ckpt_path={run_dir / 'model_final.pth'}", "robust_eval_steps=1",
                          f"run_dir={run_dir}"], timeout=240)
    result.assert_ok()
    assert not any(path.exists() for path in stale) and kept.exists()


@pytest.mark.slow
def test_a_dangling_symlink_run_dir_is_named_as_such(tmp_path):
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "gone")
    result = run_train([CONFIG, *FAST, "max_steps=1"], run_dir=link, timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    assert error_lines(result.output) == [
        f"error: run_dir '{link}' is a symbolic link to '{tmp_path / 'gone'}', which does not "
        "exist; create its target, or choose another run_dir=PATH"], result.output[-3000:]


# --------------------------------------------------------------------------------------------
# 2. The table cache: a value that does not match its checksum is computed again
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_flipped_digit_in_the_table_cache_is_computed_again(tmp_path):
    from tests.test_table_cache import _computing, _run, _table, _write_checkpoint, _write_stats

    ckpts = tmp_path / "ckpts"
    _write_checkpoint(ckpts / "a.pth", seed=0)
    _write_stats(tmp_path / "stats.npz", seed=0)
    out = tmp_path / "out"
    table = _table(tmp_path, "t", ["accuracy"], ["a"])
    assert _computing(_run(table, ckpts, out).assert_ok().output) == ["accuracy"]
    cache = out / "rows" / "a.json"
    written = json.loads(cache.read_text())
    value = written["metrics"]["accuracy"]["results"]["test_acc"]

    # one digit of the value changed: the table would show another number
    text = cache.read_text()
    found = re.search(r'"test_acc": (0\.\d*[1-8])', text)
    changed = found.group(1)[:-1] + str(int(found.group(1)[-1]) + 1)
    damaged = text[:found.start(1)] + changed + text[found.end(1):]
    cache.write_text(damaged)
    # and a killed table's temp file beside it
    stale = out / "rows" / f".a.json.{_dead_pid()}.tmp"
    stale.write_text("{")
    rerun = _run(table, ckpts, out).assert_ok()
    notices = [x for x in rerun.output.splitlines() if "do not match their checksum" in x]
    assert len(notices) == 1 and str(cache) in notices[0], rerun.output[-3000:]
    assert _computing(rerun.output) == ["accuracy"]
    assert (out / "rows" / "a.json.corrupt").read_text() == damaged
    assert json.loads(cache.read_text())["metrics"]["accuracy"]["results"]["test_acc"] == value
    assert not stale.exists()
    assert _computing(_run(table, ckpts, out).assert_ok().output) == []

    # a cache written before checksums: not verified, computed again, said once
    old = json.loads(cache.read_text())
    del old["metrics"]["accuracy"]["checksum"]
    cache.write_text(json.dumps(old))
    rerun = _run(table, ckpts, out).assert_ok()
    notices = [x for x in rerun.output.splitlines() if "without a checksum" in x]
    assert len(notices) == 1 and str(cache) in notices[0], rerun.output[-3000:]
    assert _computing(rerun.output) == ["accuracy"]
    assert (out / "rows" / "a.json.unverified").exists()
