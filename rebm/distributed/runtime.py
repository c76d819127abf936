"""The process layout of this run: rank, world size, device, process group (docs/design.md §3).

- the environment (torchrun, SLURM, mp.spawn) decides rank/world size; MASTER_ADDR/PORT set by a
  launcher are never overwritten;
- LOCAL_RANK, never RANK, picks the CUDA device;
- the ranks join within min(ddp_timeout_s, JOIN_TIMEOUT_S), or every rank that came says in one
  line which did not (`join_store`); a torchrun worker dies with its agent (`die_with_launcher`),
  a rank of the `--nproc` launcher with the launcher (`die_with_parent`).
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from rebm.errors import UserError

LOGGER = logging.getLogger("rebm")

# How long the ranks of a job may take to join, at most (ddp_timeout_s when shorter): torchrun's
# own rendezvous gives its agents the same 600 s (its `join_timeout`). Ranks of one job start
# within seconds of each other; a rank missing after that never started or failed.
JOIN_TIMEOUT_S = 600.0
PR_SET_PDEATHSIG = 1  # prctl(2)


class LaunchError(UserError, RuntimeError):
    """The launch environment is inconsistent with the config; message is one line."""


@dataclass(frozen=True)
class Runtime:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: Optional[str] = None  # None = no process group
    data_parallel: bool = False  # nn.DataParallel over several visible GPUs (use_ddp=false)
    # The preemption flag (rebm.distributed.signals.PreemptionFlag) of the training run this
    # process runs, if any: its evaluation and generation loops poll it.
    preemption: Optional[Any] = field(default=None, compare=False)

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def launch_environment() -> Dict[str, int]:
    """Rank layout from the launcher's environment: torchrun/spawn (RANK, LOCAL_RANK, WORLD_SIZE)
    first, then a task of an srun job step (SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NUM_TASKS),
    else one process. The batch script of an sbatch job has SLURM_NTASKS of the whole allocation
    but no job step: a plain `python -m ...` there is one process, not rank 0 of N peers that
    never come."""
    if _env_int("WORLD_SIZE") is not None and _env_int("RANK") is not None:
        world = _env_int("WORLD_SIZE") or 1
        rank = _env_int("RANK") or 0
        local_rank = _env_int("LOCAL_RANK") or 0
        local_world = _env_int("LOCAL_WORLD_SIZE") or world
    elif (_env_int("SLURM_STEP_NUM_TASKS") or 1) > 1 and _env_int("SLURM_PROCID") is not None:
        world = _env_int("SLURM_STEP_NUM_TASKS") or 1
        rank = _env_int("SLURM_PROCID") or 0
        local_rank = _env_int("SLURM_LOCALID") or 0
        local_world = _env_int("SLURM_NTASKS_PER_NODE") or max(
            1, world // (_env_int("SLURM_NNODES") or 1)
        )
    else:
        if (_env_int("SLURM_NTASKS") or 1) > 1 and _env_int("SLURM_STEP_NUM_TASKS") is None:
            LOGGER.warning("SLURM allocated %s tasks but this process was not started by srun: "
                           "running as one process (start it with srun or torchrun to use them)",
                           os.environ["SLURM_NTASKS"])
        world, rank, local_rank, local_world = 1, 0, 0, 1
    return dict(rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world)


def _slurm_master_env() -> None:
    """Under srun without torchrun, derive MASTER_ADDR/PORT from SLURM (only if unset)."""
    if "MASTER_ADDR" not in os.environ:
        nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
        first = "127.0.0.1"
        if nodelist:
            try:
                import subprocess

                first = subprocess.run(
                    ["scontrol", "show", "hostnames", nodelist],
                    capture_output=True, text=True, check=True, timeout=30,
                ).stdout.split()[0]
            except Exception:
                first = nodelist.split(",")[0].split("[")[0]
        os.environ["MASTER_ADDR"] = first
    if "MASTER_PORT" not in os.environ:
        job = _env_int("SLURM_JOB_ID") or 0
        os.environ["MASTER_PORT"] = str(20000 + job % 20000)


def _task_owns_one_gpu() -> bool:
    """An srun task given exactly one GPU of its own (--gpus-per-task=1, or a per-task
    CUDA_VISIBLE_DEVICES of one device), so its GPU is cuda:0 whatever its SLURM_LOCALID."""
    if "SLURM_PROCID" not in os.environ or "RANK" in os.environ:
        return False
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return os.environ.get("SLURM_GPUS_PER_TASK") == "1" or len(visible) == 1


def choose_device(local_rank: int, device: str = "auto") -> torch.device:
    """LOCAL_RANK picks the GPU (RANK would be wrong on every node but the first)."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise LaunchError("device: cuda was asked for but CUDA is not available on this machine")
    count = torch.cuda.device_count()
    if count == 1 and local_rank >= 1 and _task_owns_one_gpu():
        return torch.device("cuda", 0)  # srun --gpus-per-task=1: each task sees its own GPU 0
    if local_rank >= count:
        raise LaunchError(
            f"LOCAL_RANK {local_rank} but only {count} visible GPU(s); start at most {count} "
            "processes per node (--nproc_per_node) or fix CUDA_VISIBLE_DEVICES"
        )
    return torch.device("cuda", local_rank)


def choose_backend(device: torch.device, requested: str = "auto") -> str:
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise LaunchError(
            "ddp_backend: nccl needs CUDA devices; this machine has none: use ddp_backend=gloo "
            "(or auto)"
        )
    return requested


def cap_cpu_threads(local_world_size: int) -> int:
    """Share the node's cores between its processes unless the user set OMP_NUM_THREADS."""
    if "OMP_NUM_THREADS" in os.environ:
        threads = max(1, int(os.environ["OMP_NUM_THREADS"]))
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = max(1, (cores or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    return threads


def setup_distributed(
    use_ddp: bool = True,
    backend: str = "auto",
    device: str = "auto",
    timeout_s: float = 1800.0,
) -> Runtime:
    """Read the launch environment, pick the device, init the process group if several ranks."""
    layout = launch_environment()
    if layout["world_size"] > 1 and not use_ddp:
        raise LaunchError(
            f"use_ddp=false but the launcher started {layout['world_size']} processes; "
            "set use_ddp=true, or start one process (python -m rebm.training.train) to use "
            "DataParallel"
        )
    dev = choose_device(layout["local_rank"], device)
    cap_cpu_threads(layout["local_world_size"])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if layout["world_size"] == 1:
        data_parallel = (not use_ddp) and dev.type == "cuda" and torch.cuda.device_count() > 1
        return Runtime(device=dev, data_parallel=data_parallel)
    if "SLURM_PROCID" in os.environ and "RANK" not in os.environ:
        _slurm_master_env()
    chosen = choose_backend(dev, backend)
    if not dist.is_initialized():
        die_with_launcher()
        store = join_store(layout["rank"], layout["world_size"], timeout_s)
        dist.init_process_group(
            backend=chosen,
            rank=layout["rank"],
            world_size=layout["world_size"],
            timeout=datetime.timedelta(seconds=timeout_s),
            store=store,
        )
    return Runtime(device=dev, backend=chosen, **layout)


def die_with_launcher() -> None:
    """A torchrun worker gets SIGTERM when its agent dies (killed with -9, say): each worker
    runs in a session of its own, so nothing else would stop it, and it would train to the end
    with nobody to collect it. SIGTERM, not SIGKILL: a training run saves its state and exits as
    on any SIGTERM. The kernel's parent-death signal (prctl PR_SET_PDEATHSIG, Linux) rather than
    a thread watching the parent's pid: nothing to poll, and it reaches a busy or stopped worker
    alike. Only under torchrun, whose agent starts its workers from its main thread (the signal
    follows the thread that forked): a process started from a shell must outlive that shell
    (`nohup`). A worker whose agent died before this call finds no agent store in join_store."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()


def die_with_parent() -> None:
    """SIGTERM to this process when the thread that started it ends (prctl PR_SET_PDEATHSIG;
    Linux only, elsewhere nothing): what a torchrun worker (`die_with_launcher`) and a rank the
    `--nproc` launcher spawned (rebm.distributed.launch) get when their launcher dies."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def _where() -> str:
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


def join_store(rank: int, world_size: int, timeout_s: float) -> Any:
    """The key-value store of the process group, once every rank has checked in to it within
    min(timeout_s, JOIN_TIMEOUT_S); else a one-line LaunchError naming the ranks that did not
    (torch's own wait is silent for all of ddp_timeout_s, then a bare DistStoreError). The
    store's operations then wait up to timeout_s, as the process group's do."""
    join_s = min(timeout_s, JOIN_TIMEOUT_S)
    started = time.monotonic()
    deadline = started + join_s
    store = _connect_store(rank, world_size, join_s, deadline)
    host = socket.gethostname()
    store.set(f"rebm/joined/{rank}", host)
    missing = list(range(world_size))
    noticed = rank != 0
    while missing and time.monotonic() < deadline:
        missing = [r for r in missing if not store.check([f"rebm/joined/{r}"])]
        if missing and not noticed and time.monotonic() - started > min(30.0, join_s / 2):
            noticed = True
            sys.stderr.write(f"[rank 0/{world_size}] waiting for rank(s) "
                             f"{', '.join(map(str, missing))} to join at {_where()} (giving up "
                             f"after {join_s:.0f} s)\n")
            sys.stderr.flush()
        time.sleep(0.1)
    if missing:
        who = ", ".join(f"rank {r}" for r in missing)
        raise LaunchError(
            f"{who} of {world_size} did not join within {join_s:.0f} s (rank {rank} on {host} "
            f"waited at {_where()}): start every rank with WORLD_SIZE={world_size} and the same "
            "MASTER_ADDR/MASTER_PORT, and see the missing rank's own output for why it did not "
            f"start (the ranks wait ddp_timeout_s for each other, at most {JOIN_TIMEOUT_S:.0f} s)")
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def _connect_store(rank: int, world_size: int, join_s: float, deadline: float) -> Any:
    """Rank 0 serves the store at MASTER_ADDR:MASTER_PORT and the others connect to it; under
    torchrun every rank connects to its agent's store, under a prefix of its own attempt:
    the agent keeps one store across `--max-restarts` attempts, so the addresses a failed
    attempt's workers published are still there, and a restarted rank that read its peer's
    key before the peer rewrote it would connect to a dead port."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=join_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        agent_store = _client_store(rank, addr, port, world_size, join_s, deadline)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"rebm/attempt_{attempt}", agent_store)
    if rank == 0:
        try:
            return dist.TCPStore(addr, port, world_size, is_master=True, timeout=timeout,
                                 wait_for_workers=False)
        except RuntimeError as err:
            reason = "address already in use" if "EADDRINUSE" in str(err) else (
                str(err).splitlines()[0] if str(err) else type(err).__name__)
            raise LaunchError(
                f"rank 0 on {socket.gethostname()} cannot serve the rendezvous at {addr}:{port} "
                f"({reason}): another program holds MASTER_PORT={port}, or MASTER_ADDR is not "
                "this machine; start every rank with a free MASTER_PORT") from None
    return _client_store(rank, addr, port, world_size, join_s, deadline)


def _client_store(rank: int, addr: str, port: int, world_size: int, join_s: float,
                  deadline: float) -> Any:
    """A client of the store at addr:port, or a one-line LaunchError by `deadline`. First a
    plain connection, retried quietly (torch's own retries log a C++ stack at every failure);
    then the store's handshake, in a thread: a port that accepts connections but is not a store
    (another program holds it) makes the handshake wait forever, whatever its timeout."""
    host = socket.gethostname()
    while True:
        try:
            socket.create_connection((addr, port), timeout=5).close()
            break
        except OSError as err:
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"rank {rank} on {host} found nothing serving the rendezvous at {addr}:{port} "
                    f"({err.strerror or err}) in {join_s:.0f} s: rank 0 did not start "
                    "or failed (its output says why), or MASTER_ADDR/MASTER_PORT differ between "
                    "the ranks") from None
            time.sleep(0.5)
    connected: List[Any] = []

    def connect() -> None:
        try:
            connected.append(dist.TCPStore(addr, port, world_size, is_master=False,
                                           timeout=datetime.timedelta(seconds=_left(deadline))))
        except RuntimeError as err:
            connected.append(err)

    thread = threading.Thread(target=connect, name="rebm-store-connect", daemon=True)
    thread.start()
    thread.join(_left(deadline) + 1.0)
    if not connected or isinstance(connected[0], RuntimeError):
        why = ("it accepts connections but does not answer as one: another program holds "
               f"MASTER_PORT={port}" if not connected else str(connected[0]).splitlines()[0])
        raise LaunchError(
            f"rank {rank} on {host} could not join the rendezvous at {addr}:{port} ({why}); "
            "start every rank with a free MASTER_PORT")
    return connected[0]


def _left(deadline: float) -> float:
    return max(1.0, deadline - time.monotonic())


def teardown(runtime: Runtime) -> None:
    """Release the process group while the interpreter is whole. DDP wrappers hold the gloo
    group, and modules sit in reference cycles: left to interpreter shutdown, the group's C++
    worker threads can free tensors after Python is gone, which aborts the process (SIGABRT)
    after a run that had finished cleanly. Collecting the cycles first destroys them here."""
    if runtime.distributed and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
