"""Everything about processes lives here: process group, device, consensus, logging, launchers.

Rules this module enforces (DESIGN.md §3):
- the environment (torchrun, SLURM, mp.spawn) decides rank/world size; MASTER_ADDR/PORT set by a
  launcher are never overwritten;
- LOCAL_RANK, never RANK, picks the CUDA device;
- every rank reaches every collective: helpers below are called by all ranks, and control-flow
  decisions go through `consensus`, one all-reduce that gives every rank the same answer.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from rebm.errors import UserError

LOGGER = logging.getLogger("rebm")


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
    first, then SLURM srun (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS), else one process."""
    if _env_int("WORLD_SIZE") is not None and _env_int("RANK") is not None:
        world = _env_int("WORLD_SIZE") or 1
        rank = _env_int("RANK") or 0
        local_rank = _env_int("LOCAL_RANK") or 0
        local_world = _env_int("LOCAL_WORLD_SIZE") or world
    elif (_env_int("SLURM_NTASKS") or 1) > 1 and _env_int("SLURM_PROCID") is not None:
        world = _env_int("SLURM_NTASKS") or 1
        rank = _env_int("SLURM_PROCID") or 0
        local_rank = _env_int("SLURM_LOCALID") or 0
        local_world = _env_int("SLURM_NTASKS_PER_NODE") or max(
            1, world // (_env_int("SLURM_NNODES") or 1)
        )
    else:
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


def choose_device(local_rank: int, device: str = "auto") -> torch.device:
    """LOCAL_RANK picks the GPU (RANK would be wrong on every node but the first)."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise LaunchError("device: cuda was asked for but CUDA is not available on this machine")
    count = torch.cuda.device_count()
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
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=chosen,
            rank=layout["rank"],
            world_size=layout["world_size"],
            timeout=timeout,
            store=_per_attempt_store(layout["world_size"], timeout),
        )
    return Runtime(device=dev, backend=chosen, **layout)


def _per_attempt_store(world_size: int, timeout: datetime.timedelta) -> Optional[Any]:
    """torchrun's agent keeps one store across `--max-restarts` attempts, so the addresses that
    the workers of a failed attempt published are still there; a restarted rank that reads its
    peer's key before the peer rewrote it connects to a dead port ("Connection refused") and the
    restart fails. A prefix per attempt keeps the attempts apart. None: not under torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
        is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"rebm/attempt_{attempt}", agent_store)


def teardown(runtime: Runtime) -> None:
    if runtime.distributed and dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Collectives every rank calls
# --------------------------------------------------------------------------------------------
def _comm_device(runtime: Runtime) -> torch.device:
    return runtime.device if runtime.backend == "nccl" else torch.device("cpu")


def consensus(runtime: Runtime, **flags: bool) -> Dict[str, bool]:
    """One all-reduce (MAX) of all flags: a flag raised on any rank is seen by every rank at the
    same call, so all ranks take the same branch at the same step."""
    names = sorted(flags)
    if not runtime.distributed:
        return {k: bool(flags[k]) for k in names}
    values = torch.tensor([int(bool(flags[k])) for k in names], dtype=torch.int32,
                          device=_comm_device(runtime))
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return {k: bool(v) for k, v in zip(names, values.tolist(), strict=True)}


def broadcast_object(runtime: Runtime, obj: Any, src: int = 0) -> Any:
    """The object of rank `src` on every rank (small picklable things: a run dir, a path)."""
    if not runtime.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_comm_device(runtime))
    return box[0]


def decide_on_main(runtime: Runtime, decide: Callable[[], Any]) -> Any:
    """Run `decide()` on rank 0 only and give its result to every rank. If it raises, every rank
    raises (rank 0 the original, the others a copy), so no rank is left waiting in a collective
    for a rank that already failed. Every rank must call this."""
    outcome: Any = None
    if runtime.is_main:
        try:
            outcome = ("ok", decide())
        except Exception as err:  # shared below, then re-raised on every rank
            outcome = ("error", err)
    outcome = broadcast_object(runtime, outcome)
    kind, value = outcome
    if kind == "error":
        raise value
    return value


def broadcast_buffers(runtime: Runtime, module: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics updated from per-rank
    batches would otherwise drift apart between ranks)."""
    if not runtime.distributed:
        return
    for buffer in module.buffers():
        dist.broadcast(buffer.data, src=0)


def _all_reduce(runtime: Runtime, tensor: torch.Tensor, op: Any) -> torch.Tensor:
    if not runtime.distributed:
        return tensor.clone()
    buf = tensor.detach().to(_comm_device(runtime), copy=True)
    dist.all_reduce(buf, op=op)
    return buf.to(tensor.device)


def all_reduce_sum(runtime: Runtime, tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (returns a new tensor on the input's device)."""
    return _all_reduce(runtime, tensor, dist.ReduceOp.SUM)


def all_reduce_max(runtime: Runtime, tensor: torch.Tensor) -> torch.Tensor:
    """Maximum over ranks (returns a new tensor on the input's device)."""
    return _all_reduce(runtime, tensor, dist.ReduceOp.MAX)


def all_gather_cat(runtime: Runtime, tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-shaped tensors of all ranks along dim 0 (rank order)."""
    if not runtime.distributed:
        return tensor.detach().clone()
    buf = tensor.detach().contiguous().to(_comm_device(runtime))
    out = torch.empty((runtime.world_size * buf.shape[0], *buf.shape[1:]), dtype=buf.dtype,
                      device=buf.device)
    dist.all_gather_single(out, buf)
    return out.to(tensor.device)


def barrier(runtime: Runtime) -> None:
    if runtime.distributed:
        if runtime.backend == "nccl":
            dist.barrier(device_ids=[runtime.local_rank])
        else:
            dist.barrier()


def set_collective_timeout(runtime: Runtime, timeout_s: float) -> None:
    """Shorten the timeout of the default group once start-up (data, compile) is over, so a rank
    that stops arriving surfaces in minutes, not the 30-minute default."""
    if not runtime.distributed:
        return
    try:
        dist.set_timeout(datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, AttributeError) as err:  # not every backend supports it
        LOGGER.warning("could not shorten the collective timeout (%s)", err)


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time; the message names the ranks that did not arrive."""


def _looks_like_timeout(err: BaseException) -> bool:
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


def missing_ranks(runtime: Runtime, tag: str, wait_s: float = 10.0) -> List[int]:
    """Ranks that do not check in within `wait_s`, through the launcher's key-value store
    (which lives outside the process group, so it still works when a collective is stuck).
    Called by the ranks that saw a collective time out: the live ones all check in."""
    import time as _time

    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    store.set(f"rebm/alive/{tag}/{runtime.rank}", "1")
    deadline = _time.monotonic() + wait_s
    missing = list(range(runtime.world_size))
    while missing and _time.monotonic() < deadline:
        missing = [r for r in missing if not store.check([f"rebm/alive/{tag}/{r}"])]
        _time.sleep(0.2)
    return missing


@contextmanager
def name_stuck_ranks(runtime: Runtime, current_step: Callable[[], int]) -> Iterator[None]:
    """Turn a collective timeout into an error that says which rank(s) did not arrive (a
    stopped, hung or dead process), instead of the backend's bare timeout."""
    try:
        yield
    except RuntimeError as err:
        if not runtime.distributed or not _looks_like_timeout(err):
            raise
        step = current_step()
        try:
            missing = missing_ranks(runtime, tag=f"step{step}")
        except Exception:  # the store may be gone too; keep the original error
            raise err from None
        who = ", ".join(f"rank {r}" for r in missing) or "no rank (all checked in late)"
        raise CollectiveTimeout(
            f"collective timed out at step {step} on rank {runtime.rank}: {who} did not arrive "
            "(stopped, hung or too slow; see its log in <run_dir>/logs). Raise ddp_step_timeout_s "
            "if steps are legitimately slower."
        ) from err


# --------------------------------------------------------------------------------------------
# Logging
# --------------------------------------------------------------------------------------------
class _RankFormatter(logging.Formatter):
    def __init__(self, runtime: Runtime, with_time: bool):
        prefix = f"[rank {runtime.rank}/{runtime.world_size}] "
        fmt = ("%(asctime)s " if with_time else "") + prefix + "%(levelname)s %(message)s"
        super().__init__(fmt, datefmt="%H:%M:%S")


def setup_logging(runtime: Runtime, run_dir: Optional[str] = None) -> logging.Logger:
    """Console: rank 0 at INFO, other ranks at WARNING, prefixed [rank r/W];
    file: every rank at INFO to <run_dir>/logs/rank<r>.log."""
    logger = LOGGER
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.INFO if runtime.is_main else logging.WARNING)
    console.setFormatter(_RankFormatter(runtime, with_time=True))
    logger.addHandler(console)
    if run_dir is not None:
        log_dir = os.path.join(run_dir, "logs")
        os.makedirs(log_dir, exist_ok=True)
        file_handler = logging.FileHandler(os.path.join(log_dir, f"rank{runtime.rank}.log"))
        file_handler.setLevel(logging.INFO)
        file_handler.setFormatter(_RankFormatter(runtime, with_time=True))
        logger.addHandler(file_handler)
    return logger


# --------------------------------------------------------------------------------------------
# Standalone launcher (notebooks, tests, machines without torchrun)
# --------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn_entry(local_rank: int, fn: Callable, nprocs: int, port: int, args: tuple) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=os.environ.get("MASTER_PORT", str(port)),
    )
    fn(*args)


def spawn(fn: Callable, nprocs: int, *args: Any) -> None:
    """Run fn(*args) in `nprocs` processes with the same environment torchrun would set, so the
    code inside calls `setup_distributed()` exactly as under torchrun."""
    if nprocs == 1:
        fn(*args)
        return
    import torch.multiprocessing as mp

    mp.spawn(_spawn_entry, args=(fn, nprocs, free_port(), args), nprocs=nprocs, join=True)


# --------------------------------------------------------------------------------------------
# Preemption
# --------------------------------------------------------------------------------------------
class PreemptionFlag:
    """SIGTERM/SIGUSR1 (SLURM preemption) only set a flag; the training loop passes it through
    `consensus` at the next step so all ranks save and exit together."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self) -> None:
        self.signal_name: Optional[str] = None

    def _handler(self, signum: int, _frame: Any) -> None:
        import signal as _signal

        self.signal_name = _signal.Signals(signum).name

    def install(self) -> "PreemptionFlag":
        import signal as _signal

        for name in self.SIGNALS:
            if hasattr(_signal, name):
                _signal.signal(getattr(_signal, name), self._handler)
        return self

    @property
    def raised(self) -> bool:
        return self.signal_name is not None


def print_line(text: str) -> None:
    """Write one whole line to stdout in a single write. Ranks share the launcher's stdout, and
    print() under PYTHONUNBUFFERED writes the text and its newline separately, so two ranks'
    lines could run together ("...okrank 0/4 ...")."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _probe() -> None:
    """`torchrun ... -m rebm.distributed`: check that every rank joins and communicates.
    Prints one line per rank: its layout, device, and the result of a test all-reduce."""
    runtime = setup_distributed()
    total = all_reduce_sum(runtime, torch.tensor([float(runtime.rank + 1)], device=runtime.device))
    expected = runtime.world_size * (runtime.world_size + 1) / 2
    status = "ok" if float(total) == expected else f"WRONG (got {float(total)}, want {expected})"
    print_line(f"rank {runtime.rank}/{runtime.world_size} local_rank {runtime.local_rank} "
               f"device {runtime.device} backend {runtime.backend} all_reduce {status}")
    barrier(runtime)
    teardown(runtime)


if __name__ == "__main__":
    _probe()
