"""resume=force: every training key a resumed part was built from applies from the resumed step,
or is refused in one line before anything is written (docs/checkpoints.md, Resume).

A training state brings back where a run is (weights, moments, the scheduler's step, the
curriculum's T); loading torch's optimizer and scheduler state dicts would also bring back the
saved run's lr, weight decay and base rates. Each case continues a copy of one 3-step run (DAT,
and stage 1 with its cosine schedule) with changed keys and checks what the resumed steps USE: the
optimizer's groups in the state written after the first resumed step against those of an
optimizer built from the new config (every hyper-parameter the builder sets, not a list of
them), the logged learning_rate, the EMA's average, the curriculum's T. The keys each case
changes are checked to cover the fields of the sections the parts are built from, so a new key
there needs a case here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
import sys
from pathlib import Path

import pytest
import torch

from rebm.config import load_config
from rebm.config.optimizers import OptimizerSection
from rebm.config.sections import EmaSection
from rebm.engine.optimizers import build_optimizer
from rebm.methods.dat.curriculum import Curriculum
from rebm.models import model_from_config
from tests.helpers import (
    CONFIG,
    FAST,
    REPO,
    copy_run,
    error_lines,
    load_state,
    read_metrics,
    run_command,
    run_train,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STOP = 3  # the shared runs' length; every case resumes from their state at this step
STAGE1_CONFIG = "experiments/quickstart/digits_stage1.yaml"
TRAIN_AT = str(REPO / "InNOutRobustnessMean0_cifar100" / "train_at.py")
# odd batches; metrics, and a state, every step
STAGE1 = ["batch_size=17", "indist_attack_clf.max_steps=1", "n_imgs_per_metrics_log=17",
          "n_imgs_per_evaluation_log=null", "n_imgs_per_ckpt_save=17", "keep_last_states=100",
          "robust_eval_steps=1"]
EVERY_STEP = ["n_imgs_per_metrics_log=32"]  # DAT's metrics every step (FAST: every 2)


@pytest.fixture(scope="module")
def dat_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dat") / "run"
    run_train([CONFIG, *FAST, f"max_steps={STOP}"], run_dir=run_dir, timeout=300).assert_ok()
    return run_dir


@pytest.fixture(scope="module")
def stage1_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("stage1") / "run"
    stage1([f"max_steps={STOP}"], run_dir).assert_ok()
    return run_dir


def stage1(args, run_dir):
    return run_command([sys.executable, TRAIN_AT, STAGE1_CONFIG, *STAGE1, *args,
                        f"run_dir={run_dir}"], timeout=300)


def built_settings(config, overrides):
    """The hyper-parameters of the first parameter group of an optimizer built from the config
    `config` with `overrides` (every key but its parameters), on the meta device."""
    cfg = load_config(config, overrides)
    with torch.device("meta"):
        network = model_from_config(cfg.model, cfg.data)
        optimizer = build_optimizer(cfg.optimization, network.parameters())
    return {key: value for key, value in optimizer.param_groups[0].items() if key != "params"}


def group_settings(state):
    return {key: value for key, value in state["optimizer"]["param_groups"][0].items()
            if key != "params"}


def record(run_dir, step):
    return next(r for r in read_metrics(run_dir) if r["step"] == step and "learning_rate" in r)


def digests(run_dir: Path) -> dict:
    """Every file of a run directory but its logs (a refused start still logs its line) and the
    job's own files (.lock, .shared_check: which job holds the directory)."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.parts[len(run_dir.parts)] != "logs" and not p.name.startswith(".")}


# the keys the optimizer cases change: every field of the optimizer section
OPTIMIZER_CHANGES = ["lr=0.05", "wd=0.001", "max_grad_norm=1000.0"]
OPTIMIZER_REFUSED = "optimizer=adamw"


def test_the_cases_cover_every_key_a_restored_part_is_built_from():
    """The optimizer's, the EMA's and the curriculum's settings, enumerated from their section
    or constructor: a key added there needs a case in this file."""
    changed = {item.split("=")[0] for item in [*OPTIMIZER_CHANGES, OPTIMIZER_REFUSED]}
    section = {f.name for f in dataclasses.fields(OptimizerSection)}
    assert changed == section - {"name"} | {"optimizer"}  # the file's `optimizer` is `name`
    assert {f.name for f in dataclasses.fields(EmaSection)} == \
        {item.split("=")[0] for item in EMA_CHANGES + EMA_OFF}
    assert set(inspect.signature(Curriculum.__init__).parameters) - {"self"} == \
        set(CURRICULUM_CHANGES) | {"samples_per_attack_step"}  # read only at build: no state


@pytest.mark.parametrize("nproc", [2])
def test_changed_optimizer_settings_apply_from_the_resumed_step(dat_run, tmp_path, nproc):
    run_dir = copy_run(dat_run, tmp_path / "run")
    overrides = [*FAST, *EVERY_STEP, f"max_steps={STOP + 1}", *OPTIMIZER_CHANGES]
    run_train([CONFIG, *overrides, "resume=force"], nproc=nproc, run_dir=run_dir,
              timeout=300).assert_ok()
    used = group_settings(load_state(run_dir, STOP + 1))
    assert used == built_settings(CONFIG, overrides)
    assert (used["lr"], used["weight_decay"]) == (0.05, 0.001)
    resumed = record(run_dir, STOP + 1)
    assert resumed["learning_rate"] == 0.05
    assert "grad_norm" in resumed  # max_grad_norm set: the step clipped and logged the norm


def test_another_optimizer_is_refused_in_one_line_before_anything_is_written(dat_run, tmp_path):
    run_dir = copy_run(dat_run, tmp_path / "run")
    before = digests(run_dir)
    result = run_train([CONFIG, *FAST, f"max_steps={STOP + 1}", OPTIMIZER_REFUSED,
                        "resume=force"], run_dir=run_dir)
    assert result.returncode == 2, result.output[-4000:]
    errors = error_lines(result.output)
    assert len(errors) == 1 and "was trained with optimizer sgd and this run builds adamw " \
        "(optimizer)" in errors[0] and "optimizer=sgd" in errors[0], result.output[-4000:]
    assert "Traceback" not in result.output and digests(run_dir) == before


EMA_CHANGES = ["ema_decay=0.1"]  # under the warm-up's decay from the second average on
EMA_OFF = ["use_ema=false"]


@pytest.mark.numbers
def test_a_changed_ema_decay_is_the_decay_the_average_applies(dat_run, tmp_path):
    """The EMA after the resumed step is the previous average moved towards the new weights by
    1 - ema_decay (the warm-up's min((1 + n) / (10 + n), ema_decay) is above 0.1 from n = 1 on;
    with the saved run's 0.99 the step would apply the warm-up's 0.3 or more)."""
    run_dir = copy_run(dat_run, tmp_path / "run")
    run_train([CONFIG, *FAST, f"max_steps={STOP + 1}", *EMA_CHANGES, "resume=force"],
              run_dir=run_dir, timeout=300).assert_ok()
    before, after = load_state(run_dir, STOP), load_state(run_dir, STOP + 1)
    names = [name for name, _ in model_from_config(*_model_sections()).named_parameters()]
    for name in names:
        average = before["ema"][f"ema_model.{name}"]
        expected = average.lerp(after["model"][name], 1 - 0.1)
        assert torch.equal(after["ema"][f"ema_model.{name}"], expected), name


def _model_sections():
    cfg = load_config(CONFIG)
    return cfg.model, cfg.data


@pytest.mark.numbers
def test_amp_and_use_ema_apply_from_the_resumed_step(dat_run, tmp_path):
    """fp16 after an fp32 start: the resumed steps scale their loss (the state's scaler is a
    GradScaler's, one step old); without the EMA the final model is the trained weights."""
    run_dir = copy_run(dat_run, tmp_path / "run")
    run_train([CONFIG, *FAST, f"max_steps={STOP + 1}", "amp=fp16", *EMA_OFF, "resume=force"],
              run_dir=run_dir, timeout=300).assert_ok()
    assert load_state(run_dir, STOP)["scaler"] is None
    state = load_state(run_dir, STOP + 1)
    assert state["scaler"]["scale"] > 0 and state["scaler"]["_growth_tracker"] in (0, 1)
    assert "ema" not in state
    final = torch.load(run_dir / "model_final.pth", weights_only=True)
    assert all(torch.equal(final[name], value) for name, value in state["model"].items())


# the curriculum's constructor arguments the case changes (samples_per_attack_step switches to
# another rule, read at build only like these)
CURRICULUM_CHANGES = {"start_step": "attack.start_step=2", "max_T": "attack.max_steps=4",
                      "auc_threshold": "AUC_th=0.0", "window_size": "min_imgs_per_threshold=32"}


def test_changed_curriculum_settings_apply_from_the_resumed_step(dat_run, tmp_path):
    """The 3-step run ends at T = 1 (start 1, cap 3, AUC_th 0.6 over 2-step windows, AUCs far
    below). Resumed with start_step 2, cap 4, threshold 0 and 1-step windows, the resumed steps
    train with T = 2, 3, 4, 4: lifted to the new start, an advance after every step, the new
    cap."""
    assert load_state(dat_run, STOP)["method"]["curriculum"]["T"] == 1
    run_dir = copy_run(dat_run, tmp_path / "run")
    run_train([CONFIG, *FAST, *EVERY_STEP, f"max_steps={STOP + 4}",
               *CURRICULUM_CHANGES.values(), "resume=force"], run_dir=run_dir,
              timeout=300).assert_ok()
    trained = [record(run_dir, step)["cur_outdist_steps"] for step in range(STOP + 1, STOP + 5)]
    assert trained == [2, 3, 4, 4]


def cosine(lr, step, last):
    return lr * (0.5 * (1.0 + math.cos(math.pi * min(step, last) / last)))


@pytest.mark.numbers
def test_stage1_lr_wd_and_run_length_apply_from_the_resumed_step(stage1_run, tmp_path):
    """The 3-step cosine ends at rate 0; over 6 steps from lr 0.02 the resumed step's rate is
    0.02 x the cosine at step 3 of 6, its base rate 0.02 and weight decay 0.001."""
    run_dir = copy_run(stage1_run, tmp_path / "run")
    changes = ["lr=0.02", "wd=0.001", f"max_steps={STOP + 3}"]
    stage1([*changes, "resume=force"], run_dir).assert_ok()
    for step in range(STOP + 1, STOP + 4):  # the rate each resumed step used
        assert record(run_dir, step)["learning_rate"] == pytest.approx(
            cosine(0.02, step - 1, STOP + 3), rel=1e-12, abs=1e-15)
    state = load_state(run_dir, STOP + 1)
    used, built = group_settings(state), built_settings(STAGE1_CONFIG, [*STAGE1, *changes])
    assert used.pop("initial_lr") == 0.02 and state["scheduler"]["base_lrs"] == [0.02]
    assert used.pop("lr") == pytest.approx(cosine(0.02, STOP + 1, STOP + 3), rel=1e-12)
    assert used == {key: value for key, value in built.items() if key != "lr"}


def test_stage1_a_changed_schedule_applies_from_the_resumed_step(stage1_run, tmp_path):
    """From the cosine's end (rate 0 after step 3) to a constant rate: the resumed steps use
    the config's lr."""
    lr = load_config(STAGE1_CONFIG).optimization.lr
    run_dir = copy_run(stage1_run, tmp_path / "run")
    stage1(["lr_schedule=constant", f"max_steps={STOP + 2}", "resume=force"], run_dir).assert_ok()
    assert [record(run_dir, step)["learning_rate"] for step in (STOP + 1, STOP + 2)] == [lr, lr]
    assert load_state(run_dir, STOP + 2)["optimizer"]["param_groups"][0]["lr"] == lr


def test_a_loaded_curriculum_keeps_t_within_the_runs_start_and_cap():
    """What a resumed curriculum makes of a saved one's T = 4 (the run above raises the start
    and the cap; here the other directions): a lowered max_T caps T, a start_step below T
    leaves it, one above lifts it."""
    saved = Curriculum(start_step=1, max_T=5, auc_threshold=0.0, window_size=1)
    for _ in range(3):
        saved.update(0.9, 17)
    assert saved.T == 4
    for start_step, max_T, resumed_T in [(1, 2, 2), (3, 5, 4), (5, 6, 5)]:
        resumed = Curriculum(start_step=start_step, max_T=max_T, auc_threshold=0.0,
                             window_size=1)
        resumed.load_state_dict(saved.state_dict())
        assert resumed.T == resumed_T, (start_step, max_T)
