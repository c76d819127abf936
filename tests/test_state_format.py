"""Training states: a dict of Stateful parts (docs/checkpoints.md). States written by the flat
layout before it (format 1; tests/data_states/ holds two real ones, written at step 2 of the
runs below by the code of that time) are converted on reading, resume bit for bit, and the
universal weight loader reads both layouts."""

import shutil
from pathlib import Path

import pytest
import torch

from rebm.checkpoint.state import STATE_FORMAT, read_state
from rebm.checkpoint.weights import load_checkpoint
from rebm.config import load_config
from rebm.models import model_from_config
from tests.helpers import CONFIG, FAST, load_state, run_train

pytestmark = pytest.mark.timeout(420)

STATES = Path(__file__).parent / "data_states"
DAT_STATE = STATES / "dat_state_format1_step2.pt"  # CONFIG + FAST, max_steps=4, 1 process
STAGE1_STATE = STATES / "at_state_format1_step2.pt"  # STAGE1 below, 1 process
STAGE1 = ["experiments/quickstart/digits_stage1.yaml", "batch_size=32", "max_steps=4",
          "indist_attack_clf.max_steps=1", "n_imgs_per_metrics_log=64",
          "n_imgs_per_evaluation_log=null", "n_imgs_per_ckpt_save=32", "keep_last_states=100"]
PARTS = {"model", "optimizer", "scaler", "method", "progress", "rng", "tracker"}


def test_format1_states_are_converted_into_parts():
    dat = read_state(str(DAT_STATE))
    assert dat["format"] == STATE_FORMAT and dat["stage"] == 2 and dat["step"] == 2
    assert PARTS | {"ema"} <= set(dat)
    assert set(dat["method"]) == {"curriculum"}  # DAT's own state, no longer top-level
    assert set(dat["progress"]) == {"best", "metrics_window", "eval_pending"}
    assert dat["tracker"] == {"wandb_run_id": None}
    stage1 = read_state(str(STAGE1_STATE))
    assert stage1["stage"] == 1 and "scheduler" in stage1
    assert stage1["method"] == {"schedule": "cosine", "last_step": 4}
    for old in ("curriculum", "schedule", "last_step", "best", "wandb_run_id"):
        assert old not in dat and old not in stage1


def test_a_stage1_window_saved_as_a_list_reads_as_its_sums(tmp_path):
    """Stage-1 states written before the engine kept the metrics window as a list
    [loss sum, correct, images]; rebm/compat/state_format.py reads it as today's sums."""
    state = torch.load(STAGE1_STATE, map_location="cpu", weights_only=False)
    sums = {"clf_sum": 4.5, "correct": 3.0, "images": 64.0}
    state["metrics_window"] = list(sums.values())
    torch.save(state, tmp_path / "state.pt")
    assert read_state(str(tmp_path / "state.pt"))["progress"]["metrics_window"] == sums


def _resumed_equals_straight(tmp_path, args, state_file, module):
    """Resume from `state_file` (step 2) to step 4 and run 0 -> 4 straight: same bits (one
    thread, as the states were written: float sums differ with the thread count)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(args, run_dir=straight, timeout=300, module=module, threads=1).assert_ok()
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(state_file, resumed / "checkpoints" / "state_000000002.pt")
    out = run_train(args, run_dir=resumed, timeout=300, module=module, threads=1).assert_ok().output
    assert "resumed from" in out and "at step 2" in out
    a, b = load_state(straight, 4), load_state(resumed, 4)
    assert a["format"] == b["format"] == STATE_FORMAT
    for part in ("model", "ema"):
        for key, value in a[part].items():
            if torch.is_tensor(value):
                assert torch.equal(value, b[part][key]), (part, key)
    assert a["method"] == b["method"] and a.get("scheduler") == b.get("scheduler")


@pytest.mark.slow
def test_a_format1_dat_state_resumes_bit_identically(tmp_path):
    _resumed_equals_straight(tmp_path, [CONFIG, *FAST, "max_steps=4"], DAT_STATE,
                             "rebm.training.train")


@pytest.mark.slow
def test_a_format1_stage1_state_resumes_bit_identically(tmp_path):
    _resumed_equals_straight(tmp_path, STAGE1, STAGE1_STATE,
                             "InNOutRobustnessMean0_cifar100.train_at")


def test_the_weight_loader_reads_states_of_both_layouts(tmp_path):
    cfg = load_config(CONFIG)
    new_state = tmp_path / "state.pt"
    converted = read_state(str(DAT_STATE))
    torch.save(converted, new_state)
    for path, ema in ((DAT_STATE, True), (new_state, True), (new_state, False)):
        model = model_from_config(cfg)
        load_checkpoint(model, str(path), prefer_ema=ema)
        want = converted["ema"] if ema else converted["model"]
        got = model.state_dict()
        for key, value in got.items():
            source = want.get(f"ema_model.{key}", want.get(key)) if ema else want[key]
            assert torch.equal(value, source), (str(path), ema, key)
