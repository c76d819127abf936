"""The run's writers under file-size limits, in a real process of its own (a test starts it as
`python -m tests.state_writer_sweep RUN_DIR STATE CONFIG LIMIT...`): for each limit (bytes, set as this
process's RLIMIT_FSIZE while it writes) the CheckpointManager writes STATE (a real state file) as
the next state of RUN_DIR, then the model file (of CONFIG's model); the lock is taken under a 16-byte limit. Prints
one JSON line per write: the limit, the writer, the exception's type and its text, whether what
was there before is intact and which temp files were left."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import sys

import torch


def _digest(path: str):
    return hashlib.sha256(open(path, "rb").read()).hexdigest() if os.path.exists(path) else None


def attempt(limit: int, write, kept: str, run_dir: str) -> dict:
    """write() under the limit: its error, whether the file `kept` (what an earlier write left)
    is unchanged, and the temp files left in the run directory."""
    before = _digest(kept)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        write()
        outcome = {"error": None, "text": ""}
    except Exception as err:  # what reaches the entry point's one-line handler
        outcome = {"error": type(err).__name__, "text": str(err)}
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    leftovers = [name for folder in (run_dir, os.path.join(run_dir, "checkpoints"))
                 for name in os.listdir(folder) if name.endswith(".tmp")]
    return {**outcome, "intact": _digest(kept) == before, "leftovers": leftovers}


def main(run_dir: str, state_file: str, config: str, limits) -> None:
    from rebm.checkpoint.manager import CheckpointManager
    from rebm.checkpoint.run_directory import RunDirectory, RunDirLock
    from rebm.config import load_config
    from rebm.distributed import Runtime
    from rebm.models import model_from_config

    state = torch.load(state_file, map_location="cpu", weights_only=True)
    state["step"] = int(state["step"]) + 1
    manager = CheckpointManager(RunDirectory(run_dir), Runtime(), keep_last=1)
    cfg = load_config(config)
    model = model_from_config(cfg.model, cfg.data)
    model.load_state_dict(state["model"])
    newest = manager.run_directory.states()[0]
    for limit in limits:
        for writer, write, kept in (
                ("state", lambda: manager.save_state_all_ranks(lambda: state), newest),
                ("model", lambda: manager.save_final_all_ranks(model),
                 manager.run_directory.final_model)):
            print(json.dumps({"limit": limit, "writer": writer,
                              **attempt(limit, write, kept, run_dir)}), flush=True)
    lock = attempt(16, lambda: RunDirLock(run_dir).release(), manager.run_directory.lock_file,
                   run_dir)
    print(json.dumps({"limit": 16, "writer": "lock", **lock}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], [int(v) for v in sys.argv[4:]])
