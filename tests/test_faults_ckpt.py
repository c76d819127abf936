"""Faults of the run directory, its states and weights files (issue 48), through the real entry
points in real processes: run directories whose names hold glob characters beside real runs, file-
size limits (RLIMIT_FSIZE) while a state, a model or the lock is written, real bit flips and
misfit tensors in real states, NaN weights, a run_dir that is a file, file permissions, and
configs that read secret-looking environment variables."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from rebm.checkpoint.weights import CheckpointError, load_checkpoint
from rebm.config import ConfigError, load_config
from rebm.models import model_from_config
from tests.helpers import (
    CONFIG,
    FAST,
    REPO,
    base_env,
    copy_run,
    error_lines,
    finish,
    rebm_traceback_lines,
    run_command,
    run_train,
    state_path,
)

pytestmark = pytest.mark.timeout(600)

STATES = 5  # the shared run's states: steps 1 to 5


@pytest.fixture(scope="module")
def five_states(tmp_path_factory):
    """A finished 5-step DAT run (one process) with a state at every step."""
    run_dir = tmp_path_factory.mktemp("five") / "run"
    run_train([CONFIG, *FAST, f"max_steps={STATES}"], run_dir=run_dir, timeout=300).assert_ok()
    return run_dir


def digests(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((folder / "checkpoints").iterdir())}



def state_names(run_dir: Path) -> list:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("state_*.pt"))


# --------------------------------------------------------------------------------------------
# 1. Glob characters in a run directory's name
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name,beside", [("run*", "runA"), ("seed[1]", "seed1")])
def test_a_run_dir_named_with_glob_characters_finds_only_its_own_states(five_states, tmp_path,
                                                                        name, beside):
    """`run*` beside `runA`, `seed[1]` beside `seed1`: the new run reads and deletes nothing of
    the other run, keeps `keep_last_states` of its own, and the same command continues it."""
    other = copy_run(five_states, tmp_path / beside)
    before = digests(other)
    run_dir = tmp_path / name
    args = [CONFIG, *FAST, "keep_last_states=1"]
    first = run_train([*args, "max_steps=2"], run_dir=run_dir).assert_ok()
    assert "resumed from" not in first.output, first.output[-3000:]
    assert state_names(run_dir) == ["state_000000002.pt"]
    again = run_train([*args, "max_steps=3"], run_dir=run_dir).assert_ok()
    assert f"resumed from {run_dir}/checkpoints/state_000000002.pt at step 2" in again.output, \
        again.output[-3000:]
    assert state_names(run_dir) == ["state_000000003.pt"]
    assert digests(other) == before  # nothing of the other run read into it or deleted


# --------------------------------------------------------------------------------------------
# 2. A full disk (a file-size limit) while a state, a model or the lock is written
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_writers_under_24_file_size_limits_give_one_line_and_lose_nothing(five_states,
                                                                             tmp_path):
    """tests/state_writer_sweep.py, a real process: at each limit from 64 bytes to just under a
    state's size, the state writer fails with one line naming the file and the free space and the
    previous state is intact, no temp file is left; the model writer likewise wherever it fails;
    the lock's pid line too."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    newest = state_path(five_states, STATES)
    (run_dir / "checkpoints" / newest.name).write_bytes(newest.read_bytes())
    (run_dir / "model_final.pth").write_bytes((five_states / "model_final.pth").read_bytes())
    size = newest.stat().st_size
    limits = sorted({int(64 * (size / 64) ** (i / 23)) - 1 for i in range(24)} | {size - 100})
    assert len(limits) >= 20
    result = run_command([sys.executable, "-m", "tests.state_writer_sweep", str(run_dir),
                          str(newest), CONFIG, *map(str, limits)], timeout=300).assert_ok()
    records = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    states = [r for r in records if r["writer"] == "state"]
    assert [r["limit"] for r in states] == limits, result.output[-3000:]
    for record in records:
        if record["writer"] == "model" and record["error"] is None:
            continue  # the model file is smaller than this limit
        text = record["text"]
        assert record["error"] in ("StateError", "WriteFailed", "RunDirError"), record
        assert "\n" not in text and "free on its filesystem" in text and "ulimit -f" in text, record
        assert text.count("free on its filesystem") == 1, record  # on_main adds none of its own
        assert record["writer"] == "lock" or record["intact"], record  # a lock holds no results
        assert not record["leftovers"], record
    assert all(str(run_dir / "checkpoints" / "state_000000006.pt") in r["text"] for r in states)
    assert any("a short write" in r["text"] for r in states)  # torch.save's RuntimeError
    assert any("File too large" in r["text"] for r in states)  # an OSError
    assert any(r["writer"] == "model" and r["error"] for r in records)
    assert "'.lock'" not in records[-1]["text"] and str(run_dir / ".lock") in records[-1]["text"]
    assert state_names(run_dir) == [newest.name]


@pytest.mark.slow
def test_a_short_write_in_a_training_run_is_one_line(five_states, tmp_path):
    """The real entry point, one more step of the finished run, under a limit at which torch.save
    raises RuntimeError ("unexpected pos"), not OSError: one line, exit 2, the run's model file
    and states intact."""
    run_dir = copy_run(five_states, tmp_path / "run")
    final = run_dir / "model_final.pth"
    before = digests(run_dir), final.read_bytes()
    limit = 200_000  # larger than the logs and config.yaml, smaller than a model or a state

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.Popen(
        [sys.executable, "-m", "rebm.training.train", CONFIG, *FAST, f"max_steps={STATES + 1}",
         f"run_dir={run_dir}"], cwd=REPO, env=base_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, preexec_fn=small_files, start_new_session=True)
    code, out = finish(proc, timeout=300)
    assert code == 2, out[-4000:]
    errors = error_lines(out)
    assert len(errors) == 1 and errors[0].startswith(f"error: cannot write {final} (a short "
                                                     "write: unexpected pos"), out[-4000:]
    assert "free on its filesystem" in errors[0] and "Traceback" not in out
    assert (digests(run_dir), final.read_bytes()) == before



# --------------------------------------------------------------------------------------------
# 7. States verified and fitted before they are trusted
# --------------------------------------------------------------------------------------------
def flip_a_bit_in_tensor_data(path: Path) -> str:
    """Flip one bit in the middle of the largest tensor record of a torch.save zip; its name."""
    with zipfile.ZipFile(path) as archive:
        record = max(archive.infolist(), key=lambda info: info.file_size)
    data = bytearray(path.read_bytes())
    offset = record.header_offset
    name_length, extra_length = struct.unpack("<HH", data[offset + 26:offset + 30])
    data[offset + 30 + name_length + extra_length + record.file_size // 2] ^= 0x08
    path.write_bytes(bytes(data))
    return record.filename


@pytest.mark.slow
def test_damaged_misfit_and_nan_states_fall_back_one_line_each(five_states, tmp_path):
    """The newest four states each fail a check (a bit flip in tensor data, a model tensor of
    the wrong shape, momentum of the wrong shape, a NaN weight): one line each, and the run
    resumes from the state before them."""
    run_dir = copy_run(five_states, tmp_path / "run")
    record = flip_a_bit_in_tensor_data(state_path(run_dir, 5))

    def damage(step, change):
        state = torch.load(state_path(run_dir, step), map_location="cpu", weights_only=True)
        change(state)
        torch.save(state, state_path(run_dir, step))

    damage(4, lambda s: s["model"].__setitem__("fc.weight", torch.zeros(11, 64)))
    damage(3, lambda s: s["optimizer"]["state"][0].__setitem__("momentum_buffer",
                                                                torch.zeros(3)))
    damage(2, lambda s: s["model"]["conv1.weight"].__setitem__((0, 1, 2, 0), float("nan")))
    # keep_last_states=1: the pruning after the new state 2 must not count the unusable states
    # among the newest (they are set aside, so the good ones are not pruned for them)
    result = run_train([CONFIG, *FAST, "max_steps=2", "keep_last_states=1"],
                       run_dir=run_dir).assert_ok()
    fallbacks = [line for line in result.output.splitlines()
                 if "trying the previous state" in line]
    assert len(fallbacks) == 4, result.output[-5000:]
    for line, step, why in zip(fallbacks, (5, 4, 3, 2), (
            f"is damaged (the CRC-32 of its record '{record}'",
            "its model tensor 'fc.weight' is (11, 64), the run's (10, 64)",
            "its optimizer's 'momentum_buffer' of 'conv1.weight' is (3,)",
            "holds NaN/Inf in its model tensor 'conv1.weight'"), strict=True):
        assert str(state_path(run_dir, step)) in line and why in line, line
    assert f"resumed from {state_path(run_dir, 1)} at step 1" in result.output
    assert not rebm_traceback_lines(result.output)
    left = sorted(path.name for path in (run_dir / "checkpoints").iterdir())
    aside = [state_path(run_dir, step).name + ".unusable" for step in (2, 3, 4, 5)]
    assert left == [state_path(run_dir, 2).name, *aside], left


@pytest.mark.slow
def test_resume_force_with_another_model_type_is_one_line(five_states, tmp_path):
    run_dir = copy_run(five_states, tmp_path / "run")
    before = digests(run_dir)
    result = run_train([CONFIG, *FAST, f"max_steps={STATES + 1}", "resume=force",
                        "model.model_type=WideResNet16x2"], run_dir=run_dir)
    assert result.returncode == 2, result.output[-4000:]
    errors = error_lines(result.output)
    assert len(errors) == 1 and "holds a WideResNet10x1 model and this run builds a " \
        "WideResNet16x2" in errors[0], result.output[-4000:]
    assert "Traceback" not in result.output and digests(run_dir) == before


# --------------------------------------------------------------------------------------------
# 5 (weights). A weights file with a NaN weight
# --------------------------------------------------------------------------------------------
@pytest.fixture
def nan_model(tmp_path):
    """The quickstart model's weights file with one NaN weight."""
    cfg = load_config(CONFIG)
    weights = model_from_config(cfg.model, cfg.data).state_dict()
    weights["block1.layer.0.conv1.weight"][1, 0, 2, 0] = float("nan")
    path = tmp_path / "nan_model.pth"
    torch.save(weights, path)
    return path


def test_load_checkpoint_refuses_non_finite_weights_naming_the_tensor(nan_model):
    cfg = load_config(CONFIG)
    with pytest.raises(CheckpointError, match=r"NaN/Inf in tensor 'block1\.layer\.0\.conv1\."
                                              r"weight' \(1 of \d+ values\)"):
        load_checkpoint(model_from_config(cfg.model, cfg.data), str(nan_model))


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["rebm.eval.evaluate", "rebm.training.train"])
def test_a_nan_weight_is_refused_in_one_line_by_evaluation_and_training(nan_model, tmp_path,
                                                                        entry):
    """`python -m rebm.eval.evaluate` of the file, and a stage-2 run starting from it."""
    config = CONFIG if entry == "rebm.eval.evaluate" else "experiments/quickstart/digits_stage2.yaml"
    result = run_command([sys.executable, "-m", entry, config, f"model.ckpt_path={nan_model}",
                          "robust_eval_steps=1", "max_steps=1", f"run_dir={tmp_path / 'run'}"],
                         timeout=240)
    assert result.returncode == 2, result.output[-4000:]
    errors = error_lines(result.output)
    assert len(errors) == 1, result.output[-4000:]
    assert f"checkpoint '{nan_model}' holds NaN/Inf in tensor 'block1.layer.0.conv1.weight'" \
        in errors[0]
    assert "Traceback" not in result.output


# --------------------------------------------------------------------------------------------
# 10. Smaller faults
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_run_dir_that_is_a_file_is_named(tmp_path):
    path = tmp_path / "not_a_folder"
    path.write_text("a file\n")
    for run_dir in (path, path / "run"):
        result = run_train([CONFIG, *FAST, "max_steps=1"], run_dir=run_dir, timeout=120)
        assert result.returncode == 2, result.output[-3000:]
        assert error_lines(result.output) == [
            f"error: run_dir '{run_dir}' "
            + ("is a file" if run_dir == path else f"cannot be created: '{path}' is a file")
            + ", not a directory; choose another run_dir=PATH"], result.output[-3000:]
    assert path.read_text() == "a file\n"


@pytest.mark.slow
def test_states_and_models_have_the_permissions_of_other_run_files(five_states):
    mode = (five_states / "config.yaml").stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask
    for path in [five_states / "model_final.pth", *(five_states / "checkpoints").iterdir()]:
        assert path.stat().st_mode & 0o777 == mode, path


@pytest.mark.slow
def test_a_config_may_not_read_a_secret_from_the_environment(tmp_path, monkeypatch):
    """`${oc.env:NAME}` would copy the variable into config.yaml, every state and wandb: a name
    that says it holds a secret is refused in one line naming the key; other variables are read
    (docs/checkpoints.md)."""
    result = run_command([sys.executable, "-m", "rebm.training.train", CONFIG,
                          "wandb_project=${oc.env:WANDB_API_KEY}", "--check"], timeout=120,
                         env=base_env(extra={"WANDB_API_KEY": "not-a-real-key"}))
    assert result.returncode == 2
    assert error_lines(result.output) == [
        "error: command line: 'wandb_project' reads the environment variable WANDB_API_KEY, "
        "whose name says it holds a secret; rebm records every resolved value in config.yaml, "
        "each training state and wandb, so a config may not read it"], result.output[-3000:]
    assert "not-a-real-key" not in result.output
    config = tmp_path / "c.yaml"
    config.write_text(Path(REPO / CONFIG).read_text() + "\nwandb_dir: ${oc.env:HF_TOKEN,x}\n")
    with pytest.raises(ConfigError, match="'wandb_dir' reads the environment variable HF_TOKEN"):
        load_config(str(config))
    monkeypatch.setenv("REBM_TEST_DATA_ROOT", "/data")
    assert load_config(CONFIG, ["wandb_dir=${oc.env:REBM_TEST_DATA_ROOT}"]).logging.wandb_dir \
        == "/data"
