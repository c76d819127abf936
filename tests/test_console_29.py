"""Issue 29's console points, each from the real entry point or command: the resume hint, the
quiet setup, the CPU-wheel option of `make setup`, what evaluation prints and writes."""

import os
import signal
import subprocess
import sys

import pytest

from rebm.config import default_run_dir, load_config
from tests.helpers import CONFIG, FAST, REPO, base_env, finish, wait_for_records
from tests.processes import popen

pytestmark = pytest.mark.timeout(300)


def test_the_resume_hint_of_a_default_run_dir_is_the_plain_command(tmp_path):
    """Stopped by Ctrl-C in its default run_dir, the run says only to run the same command (a
    run_dir the user chose is named: tests/test_resume.py)."""
    config = str(REPO / CONFIG)
    args = [*FAST, "max_steps=400", "n_imgs_per_ckpt_save=100000"]
    run_dir = tmp_path / default_run_dir(config, args, load_config(config, args))
    proc = popen([sys.executable, "-m", "rebm.training.train", config, *args], base_env(1),
                 tmp_path)
    wait_for_records(run_dir, 1, proc)
    os.killpg(proc.pid, signal.SIGINT)
    code, out = finish(proc, timeout=60)
    assert code == 0, out[-4000:]
    hint = [line for line in out.splitlines() if "stopped by SIGINT" in line]
    assert len(hint) == 1, out[-4000:]
    assert hint[0].endswith("; run the same command to resume"), hint
    assert "run_dir" not in hint[0] and "Traceback" not in out
    assert list((run_dir / "checkpoints").glob("state_*.pt"))


def make_setup_commands(*variables):
    """The commands `make setup` would run in a fresh checkout (-B: as if .venv were absent)."""
    out = subprocess.run(["make", "-n", "-B", "setup", "PYTHON=python3", *variables], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    return out.splitlines()


def test_make_setup_keeps_pip_errors_but_not_the_editable_install_banner():
    """pip -q -q still prints its ERROR lines (a missing requirement, checked by hand with pip
    26.3) but hides setuptools' 'Editable installation' BuildBackendWarning banner, which a
    single -q lets through; torch and torchvision come from PyPI's default index, as before."""
    assert make_setup_commands() == [
        "test -x .venv/bin/python || python3 -m venv .venv",
        ".venv/bin/python -m pip install --quiet --upgrade pip",
        ".venv/bin/python -m pip install --quiet torch==2.14.1 torchvision==0.29.1",
        '.venv/bin/python -m pip install -q -q -e ".[dev]"',
        "touch .venv/.installed",
    ]


def test_make_setup_torch_index_installs_torch_from_that_index():
    """`make setup TORCH_INDEX=...` (the README's CPU-only setup) hands the index to the pip
    command that installs torch and torchvision, and to no other."""
    url = "https://download.pytorch.org/whl/cpu"
    default, chosen = make_setup_commands(), make_setup_commands(f"TORCH_INDEX={url}")
    torch_line = (".venv/bin/python -m pip install --quiet --index-url "
                  f"{url} torch==2.14.1 torchvision==0.29.1")
    assert chosen == [torch_line if "torch==" in line else line for line in default]
    assert sum(url in line for line in chosen) == 1
