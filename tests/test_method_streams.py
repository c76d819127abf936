"""A method's declaration — its input streams, its loss pass and its config rules — is the one
answer the batch plan, the evaluation batch and `--check`'s memory plan read."""

import sys

import pytest

from rebm.config import ConfigError, load_config, plan_batches
from rebm.methods.at import AdversarialTraining
from rebm.methods.dat import DAT
from tests.helpers import REPO, base_env, run_separately

CONFIG = "experiments/quickstart/digits.yaml"
STAGE1 = "experiments/quickstart/digits_stage1.yaml"


def test_each_method_declares_its_streams_and_loss_pass():
    assert [s.name for s in DAT.streams] == ["in", "clf", "out"]
    assert [s.name for s in AdversarialTraining.streams] == ["clf"]
    cfg = load_config(CONFIG, ["batch_size=64"])
    assert DAT.loss_streams(cfg.method) == 3 and AdversarialTraining.loss_streams(cfg.method) == 1
    # weighting the clean out-distribution images adds their forward to DAT's loss pass
    weighted = load_config(CONFIG, ["batch_size=64", "clf_outdist_weight=0.2"])
    assert DAT.loss_streams(weighted.method) == 4
    assert plan_batches(weighted.schedule, weighted.eval, 2, DAT.loss_streams(weighted.method)).eval_batch_size == 64
    assert plan_batches(cfg.schedule, cfg.eval, 4, AdversarialTraining.loss_streams(cfg.method)).eval_batch_size == 16


def test_loss_weight_rules_are_the_methods():
    cfg = load_config(CONFIG, ["clf_adv_weight=-1"])  # the config layer only types the field
    with pytest.raises(ConfigError, match="clf_adv_weight"):
        DAT.check_config(cfg.method, cfg.model, cfg.schedule)
    with pytest.raises(ConfigError, match="clf_adv_weight"):
        DAT(cfg.method, cfg.model, cfg.schedule)
    # stage 1 has no energy loss to weight (its own rule: live BatchNorm)
    stage1 = load_config(CONFIG, ["clf_adv_weight=-1", "model.use_batchnorm=true"])
    AdversarialTraining.check_config(stage1.method, stage1.model, stage1.schedule)


@pytest.mark.slow
@pytest.mark.parametrize("command, streams", [
    (["-m", "rebm.training.train", CONFIG], 3),
    ([str(REPO / "InNOutRobustnessMean0_cifar100" / "train_at.py"), STAGE1], 1),
])
def test_check_plans_memory_for_the_methods_streams(command, streams):
    out = run_separately([sys.executable, *command, "--check"], base_env(1), timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"x {streams} streams" in out.stdout


@pytest.mark.slow
def test_a_bad_loss_weight_is_one_line_under_check():
    out = run_separately([sys.executable, "-m", "rebm.training.train", CONFIG,
                          "clf_indist_weight=-0.5", "--check"], base_env(1), timeout=180)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0
    assert "error:" in out.stderr and "clf_indist_weight" in out.stderr
