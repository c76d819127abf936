"""Start-up faults (issue 48 points 8, 9 and the log handler of point 2), with real processes:
a resume never changes what a run trains without a word; a log file that cannot be written is
one line, and the run goes on; ranks that never join, a taken MASTER_PORT and a stopped rank are
one line each within a stated time; workers die with their torchrun agent."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rebm.checkpoint.state import read_state
from rebm.checkpoint.weights import atomic_torch_save
from tests.helpers import (
    CONFIG,
    FAST,
    NO_ATTACKS,
    REPO,
    base_env,
    finish,
    run_train,
    state_path,
)

pytestmark = [pytest.mark.timeout(400)]

QUICK = [CONFIG, *FAST, *NO_ATTACKS, "robust_eval=false", "n_imgs_per_metrics_log=32"]


def _forget_key(run_dir: Path, key: str) -> None:
    """Make the run look written before `key` existed: its state's config and its config.yaml
    lack the key (the state rewritten by rebm's own writer)."""
    path = str(state_path(run_dir, 1))
    state = read_state(path)
    del state["config"][key]
    atomic_torch_save(state, path)
    config_file = run_dir / "config.yaml"
    saved = yaml.safe_load(config_file.read_text())
    del saved[key]
    config_file.write_text(yaml.safe_dump(saved))


@pytest.mark.slow
def test_a_key_an_older_run_lacks_compares_as_its_default(tmp_path):
    old = tmp_path / "digits"
    run_train([*QUICK, "max_steps=1"], run_dir=old).assert_ok()
    _forget_key(old, "r1reg")
    assert "r1reg" not in torch.load(state_path(old, 1), weights_only=True)["config"]

    # The new key at another value than the default: the old run trained without it.
    refused = run_train([*QUICK, "max_steps=2", "r1reg=0.01"], run_dir=old)
    assert refused.returncode == 2, refused.output[-3000:]
    errors = [line for line in refused.output.splitlines() if "error:" in line]
    assert len(errors) == 1, refused.output[-3000:]
    assert "r1reg: unset (the default 0.0) -> 0.01" in errors[0]
    assert "resume=force" in errors[0]
    assert not state_path(old, 2).exists()

    # A new run of the same config beside it: its start-up line says how they differ, under the
    # same rule (the old run's config.yaml lacks the key too).
    beside = tmp_path / "digits-0123abcd"
    new = run_train([*QUICK, "max_steps=1", "r1reg=0.01"], run_dir=beside).assert_ok()
    notice = [line for line in new.output.splitlines() if "new run in" in line]
    assert len(notice) == 1, new.output[-3000:]
    assert "differs in r1reg: unset (the default 0.0) -> 0.01" in notice[0], notice
    assert "same training keys" not in new.output

    # At its default the old run continues.
    resumed = run_train([*QUICK, "max_steps=2"], run_dir=old).assert_ok()
    assert state_path(old, 2).exists(), resumed.output[-3000:]
    assert re.search(r"resum\w* .*step 1", resumed.output), resumed.output[-3000:]


@pytest.mark.slow
def test_a_log_file_that_cannot_be_written_is_one_line_and_the_run_goes_on(tmp_path):
    """A job requeued onto its own log file, which has reached the file-size limit
    (RLIMIT_FSIZE, as `ulimit -f` sets it): every append to it fails with EFBIG, while the run's
    other files, all smaller, are written."""
    run_dir = tmp_path / "run"
    log_file = run_dir / "logs" / "rank0.log"
    log_file.parent.mkdir(parents=True)
    limit = 64 * 2**20
    with open(log_file, "wb") as fh:
        fh.truncate(limit)  # sparse: no disk space used

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd = [sys.executable, "-m", "rebm.training.train", *QUICK, "max_steps=2",
           f"run_dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=limit_file_size,
                            start_new_session=True)
    code, output = finish(proc, timeout=240)
    assert code == 0, output[-4000:]
    assert "Logging error" not in output, output[-4000:]
    warnings = [line for line in output.splitlines() if "cannot write the log file" in line]
    assert len(warnings) == 1, output[-4000:]
    assert f"'{log_file}' (File too large;" in warnings[0]
    assert re.search(r"[\d.]+ [KMG]?B free on its filesystem", warnings[0])
    assert "logging to the console only from now on" in warnings[0]
    # the run went on: it logged to the console after the warning and finished its files
    after = output.split(warnings[0], 1)[1]
    assert "step 2/2" in after, output[-4000:]
    assert (run_dir / "model_final.pth").exists()
    assert os.path.getsize(log_file) == limit  # the file itself is as it was
