"""Collectives that every rank calls (docs/design.md §3).

Every rank reaches every collective: the helpers below are called by all ranks, and control-flow
decisions go through `consensus`, one all-reduce that gives every rank the same answer.
"""

from __future__ import annotations

import datetime
import logging
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

import torch
import torch.distributed as dist

from rebm.disk import write_failure
from rebm.distributed.runtime import Runtime
from rebm.distributed.torch_versions import (
    all_gather_single,
    set_default_group_timeout,
    unsettable_timeout,
)
from rebm.errors import UserError

LOGGER = logging.getLogger("rebm")


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


class RankFailed(UserError, RuntimeError):
    """Another rank failed at a step every rank takes together; the message is its one line."""


def _failure(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def decide_on_main(runtime: Runtime, decide: Callable[[], Any], what: str = "decide") -> Any:
    """Run `decide()` on rank 0 only and give its result to every rank. If it raises, rank 0
    raises the error and every other rank a `RankFailed` with its first line (only the message
    travels: an exception object may not survive pickling), so no rank is left waiting in a
    collective for a rank that already failed. Every rank must call this."""
    outcome: Any = None
    error: Optional[BaseException] = None
    if runtime.is_main:
        try:
            outcome = ("ok", decide())
        except Exception as err:  # shared below, then re-raised
            error, outcome = err, ("error", _failure(err))
    outcome = broadcast_object(runtime, outcome)
    if error is not None:
        raise error
    kind, value = outcome
    if kind == "error":
        raise RankFailed(f"rank 0 could not {what}: {value}")
    return value


class WriteFailed(UserError, OSError):
    """Rank 0 could not write a file of the run (full disk, permissions, a path in the way)."""


def on_main(runtime: Runtime, write: Callable[[], Any], what: str) -> None:
    """Rank 0's writes for people (model files, metrics, images): rank 0 does them, every rank
    learns whether they worked, and a failed write is one line on every rank. Every rank must
    call this."""
    def guarded() -> Any:
        try:
            return write()
        except OSError as err:
            raise WriteFailed(f"cannot {what} ({write_failure(err)}); free disk space or fix "
                              "the run directory's permissions") from None

    decide_on_main(runtime, guarded, what)


def on_every_rank(runtime: Runtime, action: Callable[[], Any], what: str) -> Any:
    """`action()` on every rank (a per-rank read, e.g. a checkpoint a node may lack); if it
    fails anywhere, every rank raises: the failing rank its own error, the others a
    `RankFailed` naming the rank(s). Every rank must call this."""
    result, error = None, None
    try:
        result = action()
    except Exception as err:
        error = err
    if not runtime.distributed:
        if error is not None:
            raise error
        return result
    failed = torch.tensor([int(error is not None)], dtype=torch.int32)
    flags = all_gather_cat(runtime, failed.to(_comm_device(runtime))).cpu().tolist()
    if error is not None:
        raise error
    if any(flags):
        ranks = ", ".join(str(r) for r, f in enumerate(flags) if f)
        raise RankFailed(f"rank {ranks} could not {what} (see the error it printed)")
    return result


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


def all_reduce_min(runtime: Runtime, tensor: torch.Tensor) -> torch.Tensor:
    """Minimum over ranks (returns a new tensor on the input's device)."""
    return _all_reduce(runtime, tensor, dist.ReduceOp.MIN)


def all_gather_cat(runtime: Runtime, tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-shaped tensors of all ranks along dim 0 (rank order)."""
    if not runtime.distributed:
        return tensor.detach().clone()
    buf = tensor.detach().contiguous().to(_comm_device(runtime))
    out = torch.empty((runtime.world_size * buf.shape[0], *buf.shape[1:]), dtype=buf.dtype,
                      device=buf.device)
    all_gather_single(out, buf)
    return out.to(tensor.device)


def barrier(runtime: Runtime) -> None:
    if runtime.distributed:
        if runtime.backend == "nccl":
            dist.barrier(device_ids=[runtime.local_rank])
        else:
            dist.barrier()


def set_collective_timeout(runtime: Runtime, timeout_s: float) -> Optional[str]:
    """Shorten the timeout of the default group once start-up (data, compile) is over, so a rank
    that stops arriving surfaces in minutes, not the 30-minute default. Returns why the timeout
    stays as it was (None: set); the caller at the first step reports it, once per run."""
    if not runtime.distributed:
        return None
    unsettable = unsettable_timeout(runtime.backend)
    if unsettable:
        return unsettable
    try:
        set_default_group_timeout(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as err:  # not every backend supports it
        return f"could not shorten the collective timeout ({err})"
    return None


class CollectiveTimeout(UserError, RuntimeError):
    """A collective did not complete in time; the message, one line, names the ranks that did
    not arrive."""


class RankLost(UserError, RuntimeError):
    """A collective lost its connection to another rank (killed, crashed, out of memory); the
    message, one line, names the ranks that are gone."""


def _looks_like_timeout(err: BaseException) -> bool:
    text = str(err).lower()
    if text.startswith("dataloader"):  # a loader's own timeout: its worker, not another rank
        return False
    return "timed out" in text or "timeout" in text


# What gloo (and a TCP store) says when the process at the other end of a connection is gone.
_LOST_PEER = ("connection reset by peer", "connection closed by peer", "broken pipe",
              "connection refused")


def _looks_like_lost_peer(err: BaseException) -> bool:
    text = str(err).lower()
    return any(words in text for words in _LOST_PEER)


def missing_ranks(runtime: Runtime, tag: str, wait_s: float = 10.0) -> List[int]:
    """Ranks that do not check in within `wait_s`, through the launcher's key-value store
    (which lives outside the process group, so it still works when a collective is stuck).
    Called by the ranks that saw a collective time out: the live ones all check in."""
    import time as _time

    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    # bounded: a store served by a stopped rank 0 would hold this call for ddp_timeout_s (the
    # run ends with the timeout's error next, so the store's own timeout is not needed again)
    store.set_timeout(datetime.timedelta(seconds=wait_s))
    store.set(f"rebm/alive/{tag}/{runtime.rank}", "1")
    deadline = _time.monotonic() + wait_s
    missing = list(range(runtime.world_size))
    while missing and _time.monotonic() < deadline:
        missing = [r for r in missing if not store.check([f"rebm/alive/{tag}/{r}"])]
        _time.sleep(0.2)
    return missing


def _missing_named(runtime: Runtime, tag: str) -> str:
    """'rank 1' (the ranks that did not check in), for the one line of a stuck or lost rank.
    The launcher's SIGTERM (torchrun stops the live ranks once one has failed) waits for the
    roll call, a few seconds: it would end this rank before its line."""
    import signal as _signal
    import threading

    in_main = threading.current_thread() is threading.main_thread()
    previous = _signal.signal(_signal.SIGTERM, _signal.SIG_IGN) if in_main else None
    try:
        missing = missing_ranks(runtime, tag=tag)
        return ", ".join(f"rank {r}" for r in missing) or "no rank (all checked in late)"
    except Exception:  # the store is gone too: it lives in rank 0, or in torchrun's agent
        return ("a rank (the store that would name it did not answer either: rank 0 or the "
                "launcher may be the one)")
    finally:
        if in_main:
            _signal.signal(_signal.SIGTERM, previous)


@contextmanager
def name_missing_ranks(runtime: Runtime, where: Callable[[], str],
                       timeout_advice: Union[str, Callable[[], str]]) -> Iterator[None]:
    """Turn a collective that timed out, or lost its connection to another rank, into one line
    that says which rank(s) did not arrive (a stopped, hung or dead process) instead of the
    backend's error: `where` says what the ranks were doing ("at step 12"), `timeout_advice`
    which setting to raise (or a function saying it when the error comes). A one-line error from an inner such block passes unchanged."""
    try:
        yield
    except (CollectiveTimeout, RankLost):
        raise
    except RuntimeError as err:
        lost = _looks_like_lost_peer(err)
        if not runtime.distributed or not (lost or _looks_like_timeout(err)):
            raise
        place = where()
        who = _missing_named(runtime, f"{'lost' if lost else 'stuck'}/{place}")
        place = f" {place}" if place else ""
        if lost:
            raise RankLost(
                f"lost the connection to another rank{place} on rank {runtime.rank}: {who} "
                "ended (killed, crashed or out of memory; see its log and the launcher's "
                "report)") from err
        raise CollectiveTimeout(
            f"collective timed out{place} on rank {runtime.rank}: {who} did not arrive "
            f"(stopped, hung or too slow; see its own output). "
            f"{timeout_advice() if callable(timeout_advice) else timeout_advice}") from err


def name_stuck_ranks(runtime: Runtime, current_step: Callable[[], int],
                     step_timeout_in_force: Callable[[], bool]):
    """`name_missing_ranks` around training steps: "at step N", whose timeout is
    ddp_step_timeout_s once `step_timeout_in_force()` (after a process's first step), the
    start-up's ddp_timeout_s before."""
    def advice() -> str:
        if step_timeout_in_force():
            return "Raise ddp_step_timeout_s if steps are legitimately slower."
        return ("It waits ddp_timeout_s before the first step of this process: raise it if the "
                "start is legitimately slower.")
    return name_missing_ranks(runtime, lambda: f"at step {current_step()}", advice)


def all_gather_by_index(runtime: Runtime, values: torch.Tensor, indices: torch.Tensor,
                        total: int) -> torch.Tensor:
    """Every rank's rows put at their indices of [0, total), on every rank (row j of this rank
    goes to indices[j]); positions no rank filled are zero. all_gather needs equal shapes: each
    rank pads to the longest rank's row count with index -1, dropped after the gather. For
    small sets (a sample grid, feature rows, scores). Every rank must call this."""
    longest = int(all_reduce_max(runtime, torch.tensor([values.shape[0]],
                                                       device=values.device)))
    pad = longest - values.shape[0]
    values = torch.cat([values, values.new_zeros((pad, *values.shape[1:]))])
    indices = torch.cat([indices.to(values.device), indices.new_full((pad,), -1).to(values.device)])
    all_values = all_gather_cat(runtime, values)
    all_indices = all_gather_cat(runtime, indices)
    keep = all_indices >= 0
    out = values.new_zeros((total, *values.shape[1:]))
    out[all_indices[keep]] = all_values[keep]
    return out

