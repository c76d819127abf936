"""A method's config rules name where the offending value was set (rebm/config/origins.py): the
command line when an override set it, else the YAML file, through the real entry points
(`python -m rebm.training.train`, stage 1's InNOutRobustnessMean0_cifar100/train_at.py), at the
start of a run and under `--check`, as one line with no traceback."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, List

import pytest
import yaml

from tests.helpers import CONFIG, REPO, base_env, run_command

TRAIN = [sys.executable, "-m", "rebm.training.train"]
TRAIN_AT = [sys.executable, str(REPO / "InNOutRobustnessMean0_cifar100" / "train_at.py")]
STAGE1_CONFIG = "experiments/quickstart/digits_stage1.yaml"

# (entry, its config, key, YAML value, what the error says)
RULES = [
    (TRAIN, CONFIG, "fixed_lr", "false", "'fixed_lr: false' is not supported in stage 2"),
    (TRAIN, CONFIG, "lr_schedule", "cosine", "'lr_schedule: cosine' is not offered in stage 2"),
    (TRAIN, CONFIG, "indist_attack_clf.attack_type", "argmin_pgd",
     "'indist_attack_clf.attack_type' is 'argmin_pgd'; DAT's classifier attack is 'pgd'"),
    (TRAIN, CONFIG, "clf_indist_weight", "-1",
     "'clf_indist_weight', 'clf_outdist_weight', 'clf_adv_weight' must be >= 0 with a positive "
     "sum; got -1, 0, 0.5"),
    (TRAIN, CONFIG, "xent_adv_weight", "-2",  # the older spelling: the key that was read
     "'clf_indist_weight', 'clf_outdist_weight', 'xent_adv_weight' must be >= 0 with a "
     "positive sum; got 0.5, 0, -2"),
    (TRAIN, CONFIG, "r1reg", "-0.5", "'r1reg' must be >= 0, got -0.5"),
    (TRAIN_AT, STAGE1_CONFIG, "model.use_batchnorm", "false",
     "stage 1 trains BatchNorm live: set model.use_batchnorm=true"),
]
IDS = [f"{'stage1' if entry is TRAIN_AT else 'stage2'}-{key}" for entry, _, key, _, _ in RULES]


def error_lines(cmd: List[str]) -> List[str]:
    """The command's output lines, after checking it stopped with exit code 2 and no
    traceback."""
    result = run_command(cmd, timeout=120, env=base_env())
    assert result.returncode == 2, result.output[-3000:]
    assert "Traceback" not in result.output, result.output[-3000:]
    return [line for line in result.output.splitlines() if line.strip()]


def config_with(config: str, key: str, value: Any, path: Path) -> Path:
    """`config` with `key` (dotted) set to the YAML `value`, written to `path`."""
    content = yaml.safe_load((REPO / config).read_text())
    *sections, leaf = key.split(".")
    node = content
    for section in sections:
        node = node.setdefault(section, {})
    node[leaf] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(content))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("check", [False, True], ids=["start", "check"])
@pytest.mark.parametrize("entry, config, key, value, message", RULES, ids=IDS)
def test_an_override_breaking_a_method_rule_names_the_command_line(entry, config, key, value,
                                                                   message, check, tmp_path):
    flags = ["--check"] if check else []
    lines = error_lines([*entry, str(REPO / config), f"run_dir={tmp_path / 'run'}",
                         f"{key}={value}", *flags])
    assert len(lines) == 1 and lines[0].startswith(f"error: command line: {message}"), lines


@pytest.mark.slow
@pytest.mark.parametrize("check", [False, True], ids=["start", "check"])
@pytest.mark.parametrize("entry, config, key, value, message", RULES, ids=IDS)
def test_a_file_breaking_a_method_rule_names_the_file(entry, config, key, value, message, check,
                                                      tmp_path):
    """Also when the command line sets other keys (`lr`): the value is the file's."""
    bad = config_with(config, key, value, tmp_path / "bad.yaml")
    flags = ["--check"] if check else []
    lines = error_lines([*entry, str(bad), f"run_dir={tmp_path / 'run'}", "lr=0.01", *flags])
    assert len(lines) == 1 and lines[0].startswith(f"error: {bad}: {message}"), lines


@pytest.mark.slow
def test_the_command_line_is_named_when_it_breaks_a_rule_before_the_file_does(tmp_path):
    """The file breaks one rule (fixed_lr) and an override another that is checked first
    (lr_schedule): the line names the command line, with the override's key."""
    bad = config_with(CONFIG, "fixed_lr", "false", tmp_path / "bad.yaml")
    lines = error_lines([*TRAIN, str(bad), "lr_schedule=cosine", "--check"])
    assert lines == ["error: command line: 'lr_schedule: cosine' is not offered in stage 2; use "
                     "constant (or null)"]
