"""The metrics window: per-rank sums since the last log, reduced over ranks once per log (one
all-reduce, which also carries the ranks' peak memory)."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

import torch

from rebm.distributed.collectives import all_reduce_sum
from rebm.distributed.runtime import Runtime


@dataclass
class MetricsWindow:
    """Sums a method adds every step (`StepResult.window`), and the steps since the last log."""

    sums: Dict[str, float] = field(default_factory=dict)
    steps: int = 0  # optimizer steps this process ran in the window (for images/s)
    started: float = field(default_factory=time.perf_counter)  # for images/s (not saved)

    def add(self, values: Dict[str, float]) -> None:
        for key, value in values.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.steps += 1

    def global_sums_all_ranks(self, runtime: Runtime, maxima: Optional[Dict[str, float]] = None
                              ) -> Tuple[Dict[str, float], Dict[str, float]]:
        """(the window summed over ranks, each of `maxima`'s values maximised over ranks): the
        one all-reduce of a log or a save. It sums one vector: the window's sums, then a slot
        per rank for its maxima (the others' slots are 0), so the maximum is taken on the host.
        Every rank calls this with the same keys, since every rank runs the same steps."""
        keys, names = sorted(self.sums), sorted(maxima or {})
        values = torch.zeros(len(keys) + runtime.world_size * len(names), dtype=torch.float64)
        values[:len(keys)] = torch.tensor([self.sums[k] for k in keys], dtype=torch.float64)
        mine = len(keys) + runtime.rank * len(names)
        values[mine:mine + len(names)] = torch.tensor([maxima[n] for n in names],
                                                      dtype=torch.float64)
        totals = all_reduce_sum(runtime, values)
        sums = dict(zip(keys, totals[:len(keys)].tolist(), strict=True))
        per_rank = totals[len(keys):].reshape(runtime.world_size, len(names))
        return sums, dict(zip(names, per_rank.amax(dim=0).tolist(), strict=True))

    def gather_all_ranks(self, runtime: Runtime) -> None:
        """Move the global sums to rank 0 and zero the others' (every rank calls this; one
        all-reduce): the next log counts the same totals, and rank 0's window is what a saved
        state holds, as a resumed run restores it."""
        totals, _ = self.global_sums_all_ranks(runtime)
        self.sums = {k: (v if runtime.is_main else 0.0) for k, v in totals.items()}

    @classmethod
    def restored(cls, saved: Dict[str, float], is_main: bool) -> "MetricsWindow":
        """A window resumed from a state: rank 0 carries the global sums, the others start at
        zero, so the next all-reduce counts them once."""
        return cls({k: (v if is_main else 0.0) for k, v in saved.items()})


# Counts of the data path kept in the window next to the method's sums (so they ride along the
# same all-reduce and the same saved state), but not handed to the method's `summarize`.
REPLACED_IMAGES = "data_replaced_images"
DATA_COUNT_KEYS = (REPLACED_IMAGES,)


def add_data_counts(window: MetricsWindow, micro_batches: Sequence) -> None:
    """Add one step's unreadable-and-replaced images (`MicroBatch.replaced`) to the window. The
    key is always written, 0 included: every rank must all-reduce the same keys."""
    replaced = float(sum(getattr(mb, "replaced", 0) for mb in micro_batches))
    window.sums[REPLACED_IMAGES] = window.sums.get(REPLACED_IMAGES, 0.0) + replaced


def pop_data_counts(totals: Dict[str, float]) -> Dict[str, float]:
    """Remove the data counts from the window's global sums (before `summarize`); returns them
    for the metrics record (`data_replaced_images`: replaced over all ranks in the window)."""
    return {key: totals.pop(key) for key in DATA_COUNT_KEYS if key in totals}


def peak_memory_mib(runtime: Runtime) -> Dict[str, float]:
    """This process's peak RSS (and CUDA max allocated) in MiB; the log takes the largest over
    the ranks in its one all-reduce."""
    peaks = {"max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}  # KiB
    if runtime.device.type == "cuda":
        peaks["max_cuda_mib"] = torch.cuda.max_memory_allocated(runtime.device) / 2**20
    return peaks
