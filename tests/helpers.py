"""What the test files share: the real entry points run in real processes with a hard timeout (so
a hang fails the test), the DAT run most tests start from, and readers of what a run wrote."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest
import torch

from rebm.config import TrainConfig
from tests import collective_guard
from tests.processes import popen

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# The shipped training configs; experiments/paper/* are evaluation tables (tests/test_table.py).
TRAINING_CONFIGS = sorted(p for p in (REPO / "experiments").rglob("*.yaml") if p.parent.name != "paper")


@dataclass
class RunResult:
    returncode: int
    output: str
    run_dir: Optional[Path]

    def assert_ok(self) -> "RunResult":
        assert self.returncode == 0, f"exit {self.returncode}\n{self.output[-6000:]}"
        return self


def base_env(threads: int = 1, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    env.update(extra or {})
    return collective_guard.environment(env)


def finish(proc, timeout: float) -> tuple:
    """(exit code, output) of a process started with start_new_session=True; if it has not
    exited within `timeout`, kill its whole process group and fail the test (a hang)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"did not exit within {timeout}s (a hang?): {proc.args}\n{out[-6000:]}")
    return proc.returncode, out


def run_command(cmd: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None,
                run_dir: Optional[Path] = None) -> RunResult:
    """Run cmd in its own process group (tests.processes: forked when it is an entry point);
    on timeout kill the whole group and fail."""
    return RunResult(*finish(popen(cmd, env or base_env(), REPO), timeout), run_dir)


def run_separately(cmd: Sequence[str], env: Dict[str, str], timeout: float
                   ) -> subprocess.CompletedProcess:
    """Run cmd like subprocess.run(capture_output=True): stdout and stderr apart."""
    proc = popen(cmd, env, REPO, split_stderr=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"did not exit within {timeout}s (a hang?): {proc.args}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def torchrun_cmd(module: str, args: Sequence[str], nproc: int) -> list:
    return [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}",
            "-m", module, *args]


def run_train(args: Sequence[str], nproc: int = 1, timeout: float = 240,
              run_dir: Optional[Path] = None, threads: int = 1,
              module: str = "rebm.training.train", extra_env=None) -> RunResult:
    """The real entry point: `python -m` for one process, `torchrun --standalone` for several."""
    args = list(args) + ([f"run_dir={run_dir}"] if run_dir is not None else [])
    if nproc == 1:
        cmd = [sys.executable, "-m", module, *args]
    else:
        cmd = torchrun_cmd(module, args, nproc)
    env = base_env(threads, extra_env)
    return run_command(cmd, timeout, env, run_dir)


def error_lines(output: str) -> List[str]:
    """rebm's `error:` lines in a job's output. torchrun's failure report repeats a worker's line
    as its root cause (`  traceback : [rank 0] error: ...`, from the worker's error file): that is
    the launcher's copy, not a second line of rebm's."""
    return [line for line in output.splitlines()
            if "error:" in line and not line.lstrip().startswith("traceback :")]


def rebm_traceback_lines(output: str) -> list:
    """Traceback frames in rebm's own code (torchrun prints its own traceback whenever a worker
    exits non-zero; the workers themselves must print one line)."""
    prefix = f'File "{REPO / "rebm"}'
    return [line for line in output.splitlines() if line.strip().startswith(prefix)]


# --------------------------------------------------------------------------------------------
# The DAT run most tests start from: the quickstart config, small and fast, but with every part
# of the method on (curriculum, both attacks, EMA), a state every step and metrics every 2 steps.
# --------------------------------------------------------------------------------------------
CONFIG = "experiments/quickstart/digits.yaml"
FAST = ["batch_size=32", "attack.max_steps=3", "attack.start_step=1", "indist_attack_clf.max_steps=2",
        "min_imgs_per_threshold=64", "n_imgs_per_metrics_log=64", "n_imgs_per_image_log=320",
        "n_imgs_per_ckpt_save=32", "keep_last_states=100", "n_imgs_per_evaluation_log=null",
        "AUC_th=0.6", "optimizer=sgd", "lr=0.005",
        # a short evaluation at the end of every run (each run of the suite pays it)
        "robust_eval_steps=2", "image_log.num_steps=4", "image_log.num_samples=20"]
NO_ATTACKS = ["attack.max_steps=0", "attack.start_step=0", "indist_attack_clf.max_steps=0"]
STRAIGHT_STEPS = 20  # the length of the session's reference runs (tests/conftest.py)


def start_torchrun(args: Sequence[str], run_dir: Path, extra: Sequence[str] = (),
                   threads: int = 1, env_extra: Optional[Dict[str, str]] = None,
                   module: str = "rebm.training.train") -> subprocess.Popen:
    """A 2-process torchrun of `module` in the background (its own process group), for tests
    that signal or kill it; `extra` are torchrun's own options. End it with finish()."""
    cmd = torchrun_cmd(module, [*args, f"run_dir={run_dir}"], 2)
    cmd[1:1] = list(extra)
    return popen(cmd, base_env(threads, env_extra), REPO)


def wait_for_records(run_dir: Path, count: int, proc: subprocess.Popen,
                     timeout: float = 180) -> None:
    """Wait until metrics.jsonl holds `count` records (the run is training); fail if the
    process ends first or nothing comes within `timeout`."""
    deadline = time.time() + timeout
    path = Path(run_dir) / "metrics.jsonl"
    while time.time() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        time.sleep(0.2)
    pytest.fail("training did not make progress")


def worker_pids(agent_pid: int) -> Dict[int, int]:
    """{rank: pid} of the workers a torchrun agent (or a spawning parent) started, read from
    their environment."""
    pids = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            if ppid != agent_pid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = dict(item.split(b"=", 1) for item in fh.read().split(b"\0") if b"=" in item)
            pids[int(env[b"RANK"])] = int(pid)
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return pids


def wait_for_workers(agent, timeout: float = 120) -> Dict[int, int]:
    """{rank: pid} of a 2-process torchrun's workers once both have started; fail if the agent
    ends first or they do not come within `timeout`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        pids = worker_pids(agent.pid)
        if len(pids) == 2:
            return pids
        assert agent.poll() is None, agent.communicate()[0][-3000:]
        time.sleep(0.2)
    pytest.fail("torchrun did not start its workers")


def process_alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by whoever adopted it, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def copy_run(source: Path, target: Path) -> Path:
    """A copy of a finished run's directory, to continue or damage without touching the
    original (a run shared by several tests)."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(".lock"))
    return target


# --------------------------------------------------------------------------------------------
# What a run wrote: metrics.jsonl and its training states. load_state is the one place that
# reads a state file; the tests use only the parts it returns.
# --------------------------------------------------------------------------------------------
TIMING_KEYS = {"imgs_per_s", "max_rss_mib"}  # wall-clock and memory differ between any two runs


def read_metrics(run_dir) -> List[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def comparable(records: List[dict]) -> List[dict]:
    """Metrics records without the keys that differ between any two runs."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


def state_path(run_dir, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"state_{step:09d}.pt"


def load_state(run_dir, step: Optional[int] = None) -> dict:
    """The training state of `run_dir` at `step` (or the state file `run_dir` itself):
    "model", "ema", "optimizer", "scheduler", "method" (e.g. DAT's curriculum), "progress", "step",
    "stage" (rebm.checkpoint.state)."""
    path = Path(run_dir) if step is None else state_path(run_dir, step)
    return torch.load(path, map_location="cpu", weights_only=True)


def save_state_as_step(state: dict, run_dir, step: int) -> Path:
    """Write `state` (from load_state) into run_dir as the state of another step; the data
    position is derived from the step alone, so a run resumes there."""
    path = state_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**state, "step": step}, path)
    return path


def tensors(part: dict) -> dict:
    return {k: v for k, v in part.items() if torch.is_tensor(v)}


def max_param_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts' floating-point tensors."""
    return max((a[k].double() - b[k].double()).abs().max().item()
               for k in a if torch.is_tensor(a[k]) and a[k].is_floating_point())


def assert_states_identical(a: dict, b: dict) -> None:
    """Bitwise: weights, EMA, optimizer moments, the curriculum and the LR schedule."""
    for part in ("model", "ema"):
        assert set(a[part]) == set(b[part])
        for key in a[part]:
            if torch.is_tensor(a[part][key]):
                assert torch.equal(a[part][key], b[part][key]), (part, key)
    opt_a, opt_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert opt_a.keys() == opt_b.keys()
    for idx in opt_a:
        for name, value in opt_a[idx].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_b[idx][name]))
    for part in ("method", "scheduler"):  # e.g. DAT's curriculum, stage 1's LR schedule
        assert a.get(part) == b.get(part), part


# --------------------------------------------------------------------------------------------
# In-process pieces shared by several test files.
# --------------------------------------------------------------------------------------------
def make_cfg(root: str, **data) -> TrainConfig:
    """A CIFAR-10 training config reading `root`, with the data options `data`."""
    cfg = TrainConfig()
    cfg.data.indist_dataset = "cifar10"
    cfg.data.indist_ds_dir = root
    cfg.data.num_workers = 0
    cfg.schedule.batch_size = 24
    cfg.data.augm_type_generation = "original"
    cfg.data.augm_type_classification = "autoaugment_cutout"
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def randomise_bn(model, seed: int = 0):
    """Non-trivial BN statistics/affine, so tests see whether BN is applied as the original."""
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
    return model
