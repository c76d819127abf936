"""The distributed runtime with real processes (gloo on CPU)."""

import ast
import os
import re
import socket
import sys

import pytest
import torch

from rebm import distributed as rd
from tests.helpers import BIN, REPO, base_env, run_command, run_train
from tests.processes import popen, spawn_ranks

pytestmark = [pytest.mark.timeout(180), pytest.mark.bridge]


def _two_ranks_worker(result_dir: str) -> None:
    """Both ranks report what they saw: a stop flag raised by rank 1 alone at call 1, then the
    collectives rebm uses."""
    runtime = rd.setup_distributed()
    seen = []
    for call in range(3):
        decision = rd.consensus(runtime, stop=(runtime.rank == 1 and call == 1), other=False)
        seen.append((call, decision["stop"], decision["other"]))
    gathered = rd.all_gather_cat(runtime, torch.full((2, 3), float(runtime.rank)))
    summed = rd.all_reduce_sum(runtime, torch.tensor([runtime.rank + 1.0]))
    obj = rd.broadcast_object(runtime, {"run_dir": f"chosen-by-{runtime.rank}"})
    with open(os.path.join(result_dir, f"rank{runtime.rank}.txt"), "w") as fh:
        fh.write(repr({"consensus": seen,
                       "collectives": (gathered[:, 0].tolist(), summed.tolist(), obj)}))
    rd.teardown(runtime)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """What each of 2 spawned ranks reported: {rank: report}."""
    result_dir = tmp_path_factory.mktemp("two_ranks")
    spawn_ranks(_two_ranks_worker, 2, str(result_dir))
    return {rank: ast.literal_eval((result_dir / f"rank{rank}.txt").read_text())
            for rank in range(2)}


@pytest.mark.slow
def test_consensus_flag_from_one_rank_reaches_all(two_ranks):
    # Rank 1 alone raises the flag; both ranks must see it at the same call.
    for rank in range(2):
        assert two_ranks[rank]["consensus"] == [(0, False, False), (1, True, False),
                                                (2, False, False)]


@pytest.mark.slow
def test_collectives_agree_on_every_rank(two_ranks):
    for rank in range(2):
        assert two_ranks[rank]["collectives"] == ([0.0, 0.0, 1.0, 1.0], [3.0],
                                                  {"run_dir": "chosen-by-0"})


def test_layout_from_torchrun_env_on_second_node(monkeypatch):
    # Node 1 of 2, second process: RANK 3 but LOCAL_RANK 1.
    for key, value in dict(RANK="3", LOCAL_RANK="1", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(key, value)
    layout = rd.launch_environment()
    assert layout == dict(rank=3, local_rank=1, world_size=4, local_world_size=2)
    # The device index comes from LOCAL_RANK: with 2 GPUs per node, RANK 3 would not exist.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert rd.choose_device(layout["local_rank"]) == torch.device("cuda", 1)
    with pytest.raises(rd.LaunchError, match="LOCAL_RANK 3"):
        rd.choose_device(layout["rank"])


def test_layout_from_slurm_env(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in dict(SLURM_PROCID="5", SLURM_LOCALID="1", SLURM_NTASKS="8",
                           SLURM_STEP_NUM_TASKS="8", SLURM_NNODES="2").items():
        monkeypatch.setenv(key, value)
    assert rd.launch_environment() == dict(rank=5, local_rank=1, world_size=8, local_world_size=4)
    # srun --gpus-per-task=1: the task's one visible GPU is cuda:0, whatever its SLURM_LOCALID
    monkeypatch.setenv("SLURM_GPUS_PER_TASK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert rd.choose_device(1) == torch.device("cuda", 0)
    monkeypatch.delenv("SLURM_GPUS_PER_TASK")
    with pytest.raises(rd.LaunchError, match="LOCAL_RANK 1 but only 1 visible"):
        rd.choose_device(1)  # torchrun-style: two processes must not share one GPU


SBATCH_BATCH_STEP = dict(SLURM_JOB_ID="77", SLURM_NTASKS="4", SLURM_NPROCS="4",
                         SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NNODES="1")


def test_the_batch_script_of_an_sbatch_job_is_one_process(tmp_path):
    """`python -m ...` in an sbatch script (SLURM_NTASKS=4, no srun job step) runs as one
    process instead of waiting 30 minutes for three peers that never come."""
    env = base_env(1, SBATCH_BATCH_STEP)
    result = run_command([sys.executable, "-m", "rebm.distributed"], timeout=60, env=env)
    result.assert_ok()
    assert "rank 0/1" in result.output and "all_reduce ok" in result.output
    assert "not started by srun" in result.output


def test_nccl_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("machine has CUDA")
    with pytest.raises(rd.LaunchError, match="ddp_backend"):
        rd.choose_backend(torch.device("cpu"), "nccl")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_node_rendezvous_on_one_machine():
    port = _free_port()
    env = base_env(threads=1)
    agents = []
    for node_rank in range(2):
        cmd = [str(BIN / "torchrun"), "--nnodes=2", f"--node_rank={node_rank}",
               "--nproc_per_node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-id=rebm-test", "-m", "rebm.distributed"]
        agents.append(popen(cmd, env, REPO))
    outputs = []
    try:
        for agent in agents:
            out, _ = agent.communicate(timeout=150)
            outputs.append(out)
            assert agent.returncode == 0, out
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, 9)
    # Searched, not split into lines: the agents' children share one pipe per node.
    reports = re.findall(r"rank (\d+)/(\d+) local_rank \d+ device \S+ backend \S+ all_reduce (\w+)",
                         "".join(outputs))
    assert len(reports) == 4, outputs
    assert all(world == "4" and status == "ok" for _, world, status in reports), reports
    assert sorted(int(rank) for rank, _, _ in reports) == [0, 1, 2, 3]


@pytest.mark.slow
def test_use_ddp_false_under_torchrun_is_refused(tmp_path):
    result = run_train(["experiments/quickstart/digits.yaml", "use_ddp=false", "max_steps=1"],
                       nproc=2, timeout=120, run_dir=tmp_path / "run")
    assert result.returncode != 0
    assert "error: use_ddp=false but the launcher started 2 processes" in result.output
    # torchrun's agent prints its own summary; the workers themselves print no traceback.
    assert "rebm/training" not in result.output
