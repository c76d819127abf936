"""A new loss term is its function and its key (docs/design.md §6, "a loss term"): in a copy of
the package, a test adds an energy-magnitude regulariser by editing only the files that row
names, then trains two steps with it through the real entry point and finds it in the metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import CONFIG, FAST, REPO, base_env

pytestmark = pytest.mark.slow

# The new term: lambda * mean of s(x)^2 over every energy stream (an energy-magnitude penalty).
FUNCTION = '''
def energy_l2(out: LossForward, weight: float) -> Tensor:
    """energy_l2reg * mean s(x)^2 over the energy streams: keeps the energies small."""
    return weight * torch.cat(out.scores).pow(2).mean()

'''
ENTRY = '    LossTerm("energy_l2", "energy_l2reg", energy_l2),\n'
KEY = "energy_l2reg"


def loss_term_row_files() -> list:
    """The files design.md §6's "a loss term" row says a new term changes."""
    rows = [line for line in (REPO / "docs/design.md").read_text().splitlines()
            if line.startswith("| a loss term |")]
    assert len(rows) == 1, rows
    return sorted(set(re.findall(r"`(rebm/[\w/]+\.py)`", rows[0])))


def add_term(objective: Path) -> None:
    """Its function above `TERMS` and its entry at the end of `TERMS`."""
    text = objective.read_text()
    start = text.index("\nTERMS: ")
    start = text.rindex("\n\n", 0, start) + 2  # above the comment that introduces TERMS
    end = text.index("\n)\n", start) + 1
    objective.write_text(text[:start] + FUNCTION.lstrip("\n") + text[start:end] + ENTRY
                         + text[end:])


def add_key(config_file: Path) -> None:
    """The weight's field next to r1reg's (the precedent), with r1reg's type and default."""
    lines = config_file.read_text().splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if re.match(r"\s+r1reg:", line)]
    assert len(at) == 1, f"{config_file}: no single r1reg field to put {KEY} beside"
    field = re.sub(r"#.*", "# weight of the test's energy_l2 term", lines[at[0]])
    lines.insert(at[0] + 1, field.replace("r1reg", KEY, 1).rstrip() + "\n")
    config_file.write_text("".join(lines))


def test_a_new_loss_term_is_its_function_and_its_key(tmp_path):
    copy = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "rebm", copy / "rebm", ignore=ignore)
    shutil.copytree(REPO / "experiments/quickstart", copy / "experiments/quickstart")
    named = loss_term_row_files()
    assert "rebm/methods/dat/objective.py" in named, named
    for name in named:
        assert (copy / name).is_file(), f"design.md §6 names {name}, which does not exist"
        if name.endswith("objective.py"):
            add_term(copy / name)
        else:  # the row's other files are where the weight's key is declared
            add_key(copy / name)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rebm.training.train", CONFIG, *FAST, "max_steps=2",
           "n_imgs_per_metrics_log=32", f"{KEY}=0.1", f"run_dir={run_dir}"]
    env = base_env(1, {"PYTHONPATH": str(copy)})  # the copy, a new interpreter: not the
    # suite's forked processes, which imported this checkout's rebm
    done = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "train_energy_l2_loss" in r]
    assert [r["step"] for r in logged] == [1, 2]  # metrics every step (32 images)
    for record in logged:
        assert record["train_energy_l2_loss"] > 0
        assert {"train_ebm_binary_loss", "train_r1_loss", "train_clf_loss"} <= set(record)
    assert f"{KEY}: 0.1" in (run_dir / "config.yaml").read_text()
