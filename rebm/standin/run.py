"""Running a recipe's stages on the stand-in data: the real entry points under torchrun on
`nproc` CPU processes (gloo), wandb offline, FID on the shipped stand-in features, each command's
output in <folder>/logs/, each with a bounded time. The FID reference statistics are written by
the real command (`python -m rebm.eval.fid_stats`) from the stand-in data."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Dict, List

from rebm.errors import UserError
from rebm.standin.recipes import TRAIN_AT, Stage

STANDIN_ENV = {"REBM_FID_FEATURES": "rebm.eval.standin:features", "WANDB_MODE": "offline",
               "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
LOG_TAIL_LINES = 30


class StandinRunFailed(UserError):
    """A command of the stand-in run exited with an error or ran out of time."""


def child_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    return env | STANDIN_ENV


def run_logged(cmd: List[str], folder: str, log_name: str, timeout_s: float) -> float:
    """Run `cmd` in `folder` (its own process group), output to logs/<log_name>.log; the seconds
    it took. A failure prints the log's last lines and raises StandinRunFailed."""
    os.makedirs(os.path.join(folder, "logs"), exist_ok=True)
    log_path = os.path.join(folder, "logs", f"{log_name}.log")
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=folder, env=child_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGTERM)  # a training run saves a state on SIGTERM
            proc.wait()
            raise
    if code != 0:
        with open(log_path) as log:
            tail = log.read().splitlines()[-LOG_TAIL_LINES:]
        print("\n".join(tail), file=sys.stderr)
        what = f"exited with {code}" if code is not None else f"ran past {timeout_s:.0f} s"
        raise StandinRunFailed(f"{log_name} {what}; its output: {log_path}")
    return time.monotonic() - start


def stage_command(stage: Stage, nproc: int) -> List[str]:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
              f"--nproc_per_node={nproc}"]
    entry = [str(TRAIN_AT)] if stage.number == 1 else ["-m", "rebm.training.train"]
    return [*launch, *entry, str(stage.config.resolve()), *stage.overrides]


def fid_statistics_command(stage: Stage) -> List[str]:
    """The statistics of the stand-in training images at the stand-in run's data sizes."""
    data_sizes = [o for o in stage.overrides if o.startswith("data.")]
    return [sys.executable, "-m", "rebm.eval.fid_stats", str(stage.config.resolve()),
            *data_sizes,
            "--out", stage.cfg.image_log.data_dir]
