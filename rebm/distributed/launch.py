"""Standalone launcher (notebooks, tests, machines without torchrun) and the rendezvous probe
`torchrun ... -m rebm.distributed`."""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

import torch

from rebm.distributed.collectives import all_reduce_sum, barrier
from rebm.distributed.logs import print_line
from rebm.distributed.runtime import die_with_parent, setup_distributed, teardown
from rebm.distributed.signals import forward_signals


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
    # As a torchrun worker: SIGTERM when the launcher dies (kill -9), so the rank saves its
    # state and says its launcher ended. It replaces the SIGINT torch's spawn wrapper asks for,
    # which a rank takes for a Ctrl-C; a SIGINT that came before this still stops the rank.
    die_with_parent()
    fn(*args)


def spawn(fn: Callable, nprocs: int, *args: Any, start_method: str = "spawn") -> None:
    """Run fn(*args) in `nprocs` processes with the same environment torchrun would set, so the
    code inside calls `setup_distributed()` exactly as under torchrun. `start_method` is
    multiprocessing's: "spawn" starts new interpreters; "forkserver" forks them from a server
    process that has imported what multiprocessing.set_forkserver_preload names, once."""
    if nprocs == 1:
        fn(*args)
        return
    import torch.multiprocessing as mp

    context = mp.start_processes(_spawn_entry, args=(fn, nprocs, free_port(), args),
                                 nprocs=nprocs, join=False, start_method=start_method)
    with forward_signals([proc.pid for proc in context.processes]):
        while not context.join():
            pass



def probe() -> None:
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
