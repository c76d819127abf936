"""Ctrl-C and SIGTERM of the evaluation entry point under torchrun (issue 29): every rank stops
at the next batch, the job prints one notice and one line naming what happened and how to go
on, no rank prints a traceback or a broken-connection error, and nothing half-done is written.
(The table runner's stop: tests/test_table.py.)"""

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from rebm.config import load_config
from rebm.models import model_from_config
from tests.helpers import CONFIG, REPO, base_env, finish, rebm_traceback_lines, torchrun_cmd
from tests.processes import popen

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # torchrun jobs


def wait_for(log: Path, marker: str, proc, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while marker not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"'{marker}' did not appear"
        time.sleep(0.2)


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_stops_evaluate_on_every_rank_with_one_line(tmp_path, signame):
    ckpt = tmp_path / "model.pth"
    cfg = load_config(CONFIG)
    torch.save(model_from_config(cfg.model, cfg.data).state_dict(), ckpt)
    out = tmp_path / "out"
    # robust accuracy in many short batches: the evaluation is running when the signal comes,
    # and its next batch comes well within torchrun's grace period even on a loaded machine
    cmd = torchrun_cmd("rebm.eval.evaluate", [CONFIG, f"model.ckpt_path={ckpt}", f"run_dir={out}",
                                              "data.num_workers=0", "robust_eval_steps=50",
                                              "per_device_eval_batch_size=8",
                                              "eval.num_images=1024"], 2)
    log = tmp_path / "console.log"
    proc = popen(cmd, base_env(1), REPO, output=str(log))
    wait_for(log, "eval.json will be written", proc)
    time.sleep(1.0)  # inside the evaluation loop
    if signame == "SIGINT":
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: torchrun and both ranks
    else:
        proc.send_signal(signal.SIGTERM)  # SLURM: torchrun's agent, which passes it on
    code, _ = finish(proc, timeout=120)
    text = log.read_text()
    assert code != 0, text[-4000:]
    stopped = [line for line in text.splitlines() if "stopped by" in line]
    assert len(stopped) == 1, text[-4000:]
    assert stopped[0].endswith(f"stopped by {signame}: the evaluation did not finish, so no "
                               "eval.json was written; run the same command to evaluate again")
    notices = [line for line in text.splitlines() if "interrupt: stopping" in line]
    assert len(notices) == (1 if signame == "SIGINT" else 0), text[-4000:]
    assert not rebm_traceback_lines(text), text[-4000:]
    assert "Connection closed" not in text and "KeyboardInterrupt" not in text, text[-4000:]
    assert "error:" not in text
    assert not (out / "eval.json").exists()
