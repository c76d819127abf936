"""What differs between the torch releases rebm supports (2.8 to 2.14), in one place.

Each bridge names the releases that need it and what differs in behaviour. Bit-exact
invariants (resume, DDP ≡ one process, 1/2/3-rank evaluation) hold within one release, not
across releases: kernels and their rounding change between releases as between CPUs
(docs/design.md §7, numbers and machines). The supported range is declared in pyproject.toml;
`make test-oldest` runs the fast suite and the tests that exercise each bridge on its lower end.
"""

from __future__ import annotations

import datetime
import inspect
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def torch_release() -> tuple:
    """(major, minor) of the running torch, e.g. (2, 11)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def distributed_data_parallel(module: torch.nn.Module, *, forward_sync_buffers: bool,
                              **options) -> DDP:
    """DDP whose replicas are identical once it is built (parameters and buffers broadcast from
    rank 0), and whose buffers are broadcast again before every forward only if
    `forward_sync_buffers` (live BatchNorm; frozen BatchNorm never changes its statistics).

    torch >= 2.13 says exactly this with `forward_sync_buffers` (and deprecates
    `broadcast_buffers`). Before 2.13 one switch, `broadcast_buffers`, governs both broadcasts:
    False also skips the one at construction, so replicas whose buffers differ would stay
    different. The bridge builds with `broadcast_buffers=False` and then broadcasts every buffer
    from rank 0 itself, the construction broadcast 2.13 keeps. Every rank calls it (DDP's own
    construction is a collective as well)."""
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return DDP(module, forward_sync_buffers=forward_sync_buffers, **options)
    model = DDP(module, broadcast_buffers=forward_sync_buffers, **options)
    if not forward_sync_buffers:
        group = options.get("process_group")
        for buffer in module.buffers():  # rank 0 of the group, as DDP's own broadcast
            dist.broadcast(buffer.data, group=group, group_src=0)
    return model


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor) -> None:
    """Every rank's `tensor` into `output`, concatenated along dim 0 in rank order.

    torch >= 2.13 names it `all_gather_single` and deprecates `all_gather_into_tensor`, the
    name 2.8-2.12 have; same semantics."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor)


def unsettable_timeout(backend: str) -> Optional[str]:
    """Why this torch cannot shorten the default group's timeout after start-up (None: it can).

    torch 2.8's gloo keeps the timeout its process group was made with whatever is set later
    (from 2.9 gloo honours it); a stuck rank is then named after `ddp_timeout_s`, not after
    `ddp_step_timeout_s`. NCCL is not affected."""
    if backend == "gloo" and torch_release() < (2, 9):
        return (f"torch {torch.__version__}'s gloo cannot shorten the collective timeout after "
                "start-up (torch >= 2.9 can): a rank that stops arriving is named after "
                "ddp_timeout_s, not ddp_step_timeout_s")
    return None


def set_default_group_timeout(timeout: datetime.timedelta) -> None:
    """The default process group's timeout for the collectives that follow.

    `torch.distributed.set_timeout` from torch 2.14; before it the same operation is
    `distributed_c10d._set_pg_timeout` (2.8-2.13)."""
    setter = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    setter(timeout)
