"""torch.compile across restarts: the compiled artifacts of a run kept in its run directory.

A preempted job usually resumes on another node, whose local inductor cache (/tmp) is empty, so
without this every restart pays the whole compile again (tens of seconds on CPU, minutes for a
large model on GPU). PyTorch's portable cache ("mega-cache": `torch.compiler.save_cache_artifacts`
/ `load_cache_artifacts`) bundles the inductor FX-graph, AOTAutograd, Triton, autotuning and
dynamic-shape (PGO) entries into one blob: rank 0 writes it to
`<run_dir>/compile_cache/<key>.bin` after each step that compiled something new, and every rank
loads it before its first compile. No collective is involved (rank 0 writes, every rank reads;
the write is an atomic rename, so a reader sees a whole file or the previous one).

The key hashes what the compiled code depends on besides the graphs themselves: torch and Python
versions, the device (and GPU model) and the model-shaping config (architecture, classes, image
size, amp, memory format). Inside the blob each entry is keyed by its own graph hash, so a stale
entry can only miss, never be used wrongly.

Recompilations are counted with dynamo's counters (`compiled_graphs`): a DAT run compiles two
graphs per process (the attack forward, whose input requires grad, and the loss forward); the
curriculum's T, evaluation (on the uncompiled module) and the last batch (dropped) add none.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from typing import Optional, Tuple

import torch

LOGGER = logging.getLogger("rebm")


def compiled_graphs() -> int:
    """Graphs dynamo compiled in this process so far (the first compiles plus recompiles)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def cache_key(device: torch.device, shaping: dict) -> str:
    """Short hash of torch/Python versions, the device and the model-shaping config values."""
    parts = {"torch": torch.__version__, "python": platform.python_version(),
             "device": device.type, **shaping}
    if device.type == "cuda":
        parts["gpu"] = torch.cuda.get_device_name(device)
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class CompileCache:
    """The compile cache of one run: `load()` before the first compile, `after_step()` after
    each training step (saves when something new was compiled; rank 0 only)."""

    def __init__(self, path: str, writer: bool):
        self.path = path  # <run_dir>/compile_cache/<key>.bin (RunDirectory.compile_cache)
        self.writer = writer
        self.loaded = 0  # artifacts loaded at start-up
        self.saved_graphs = compiled_graphs()
        self.first_graphs: Optional[int] = None  # graphs after the first step

    def load(self) -> str:
        """Load the run's artifacts, if any; returns a phrase for the start-up log line."""
        if not os.path.exists(self.path):
            return f"cache {self.path} (empty: the first compile is saved there)"
        with open(self.path, "rb") as fh:
            blob = fh.read()
        try:
            info = torch.compiler.load_cache_artifacts(blob)
        except Exception as err:  # a truncated or foreign file: compile afresh, overwrite it
            LOGGER.warning("compile cache %s unreadable (%s); compiling afresh", self.path, err)
            return f"cache {self.path} (unreadable: compiling afresh)"
        self.loaded = sum(map(len, info.artifacts.values())) if info is not None else 0
        return f"cache {self.path} (loaded {self.loaded} artifacts)"

    def after_step(self) -> None:
        graphs = compiled_graphs()
        if graphs == self.saved_graphs:
            return
        if self.first_graphs is None:
            self.first_graphs = graphs
        else:
            LOGGER.info("torch.compile: %d recompilation(s) so far (graphs: %d after the first "
                        "step, %d now)", graphs - self.first_graphs, self.first_graphs, graphs)
        self.saved_graphs = graphs
        if self.writer:
            self.save()

    def save(self) -> None:
        result = torch.compiler.save_cache_artifacts()
        if result is None:
            return
        tmp = f"{self.path}.tmp{os.getpid()}"
        try:  # best effort, rank 0 alone: a failed write must not stop (or desync) the run
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(tmp, "wb") as fh:
                fh.write(result[0])
            os.replace(tmp, self.path)
        except OSError as err:
            LOGGER.warning("could not write the compile cache %s (%s); the next restart "
                           "compiles afresh", self.path, err.strerror or err)


def open_cache(path: Optional[str], writer: bool) -> Tuple[Optional[CompileCache], str]:
    """The run's compile cache in the file `path`, loaded (call before the first compile; the
    training run owns it and calls `after_step`), and a phrase for the start-up log line.
    Without a run directory (no path) nothing is cached (None)."""
    if not path:
        return None, "no cache (no run_dir)"
    cache = CompileCache(path, writer)
    return cache, cache.load()
