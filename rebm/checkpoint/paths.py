"""Where a run's files are, for the commands that take a run: `model.ckpt_path` may name a
weights file or a run directory (its `model_final.pth`), and a path that does not exist is
reported with the runs of the same config beside it. A run started with changed training keys
and no `run_dir` lives in `<config name>-<hash>` (rebm.config.identity.default_run_dir), so the
path a README or a script spells out is often one such sibling away."""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from typing import List

from rebm.checkpoint.state import list_states
from rebm.checkpoint.weights import CheckpointError
from rebm.config import TrainConfig, freeze

FINAL_MODEL = "model_final.pth"
RUN_CONFIG = "config.yaml"  # every training run writes it first (rebm.engine.tracking)
_HASHED = re.compile(r"^(?P<name>.+)-[0-9a-f]{8}$")


def config_run_name(run_dir: str) -> str:
    """The run directory's name without its `-<hash>` of training overrides."""
    name = os.path.basename(os.path.normpath(run_dir))
    hashed = _HASHED.match(name)
    return hashed.group("name") if hashed else name


def sibling_runs(run_dir: str) -> List[str]:
    """The other runs of the same config beside `run_dir` (`<name>` and `<name>-<hash>` folders
    holding a config.yaml), sorted, spelled like `run_dir`."""
    parent = os.path.dirname(os.path.normpath(run_dir))
    name = config_run_name(run_dir)
    candidates = [os.path.join(parent, name)]
    candidates += glob.glob(os.path.join(parent, glob.escape(name) + "-*"))
    same = os.path.abspath(run_dir)
    return sorted(path for path in candidates
                  if (path == os.path.join(parent, name) or _HASHED.match(os.path.basename(path)))
                  and os.path.abspath(path) != same
                  and os.path.isfile(os.path.join(path, RUN_CONFIG)))


def model_file(path: str, key: str = "model.ckpt_path") -> str:
    """The weights file `path` (the config key `key`) stands for: the file itself, or a run
    directory's model_final.pth. CheckpointError in one line otherwise: an unfinished run names
    its newest training state, a missing path the runs of the same config beside it."""
    if os.path.isdir(path):
        final = os.path.join(path, FINAL_MODEL)
        if os.path.isfile(final):
            return final
        states = list_states(path)
        hint = (f"; the run has not finished: pass {key}={states[0]} (its newest training "
                "state), or finish the run with its own command" if states else
                f"; pass {key}=FILE of the weights to use")
        raise CheckpointError(f"{key} '{path}' is a directory without {FINAL_MODEL}{hint}")
    if os.path.exists(path):
        return path
    run_dir = os.path.dirname(path) if os.path.basename(path) == FINAL_MODEL else path
    siblings = sibling_runs(run_dir) if run_dir else []
    hint = (f"; runs of the same config here: {', '.join(siblings)} (a run started with "
            f"changed training keys gets a -<hash> name; {key}=RUN_DIR takes its "
            f"{FINAL_MODEL})" if siblings else "")
    raise CheckpointError(f"{key} '{path}' does not exist{hint}")


def check_starting_weights(cfg: TrainConfig) -> None:
    """CheckpointError (one line, `model_file`'s) when a new run's `model.ckpt_path` does not
    exist. A run directory holding training states resumes from them and does not read the file
    (it may have moved since), so it is not checked then. Called before the run directory is
    created: a typo leaves nothing behind."""
    path = cfg.model.ckpt_path
    if not path or os.path.exists(path):
        return
    if cfg.run_dir and os.path.isdir(cfg.run_dir) and list_states(cfg.run_dir):
        return
    model_file(path)


def with_model_file(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with `model.ckpt_path` resolved by `model_file` (unchanged when unset)."""
    if not cfg.model.ckpt_path:
        return cfg
    model = dataclasses.replace(cfg.model, ckpt_path=model_file(cfg.model.ckpt_path))
    return freeze(dataclasses.replace(cfg, model=model), cfg._explicit_keys)
