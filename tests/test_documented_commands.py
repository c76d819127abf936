"""Every command the documentation gives keeps working as written: each `python -m rebm...`
module and script named in README.md and docs/ answers `--help` with its usage (design.md §6:
the entry commands)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers import REPO, base_env

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCRIPTS = ("InNOutRobustnessMean0_cifar100/train_at.py",)


def documented_commands():
    """The rebm modules run with `-m` and the entry scripts the documents name."""
    text = "\n".join(path.read_text() for path in DOCUMENTS)
    modules = sorted(set(re.findall(r"-m (rebm(?:\.[A-Za-z_0-9]+)+)", text)))
    scripts = [script for script in SCRIPTS if script in text]
    return [["-m", module] for module in modules] + [[script] for script in scripts]


def test_the_documents_name_the_commands():
    names = {" ".join(command) for command in documented_commands()}
    assert {"-m rebm.eval.evaluate", "-m rebm.eval.table", "-m rebm.eval.fid_stats",
            "-m rebm.eval.counterfactuals", "-m rebm.training.train",
            "InNOutRobustnessMean0_cifar100/train_at.py"} <= names


@pytest.mark.parametrize("command", documented_commands(), ids=" ".join)
def test_each_documented_command_answers_help(command):
    result = subprocess.run([sys.executable, *command, "--help"], cwd=REPO, env=base_env(1),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.lstrip().startswith("usage:"), result.stdout[:500]
