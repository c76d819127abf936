"""Where a run's files are, for the commands that take a run: `model.ckpt_path` may name a
weights file or a run directory (its `model_final.pth`), and a path that does not exist is
reported with the runs of the same config beside it. A run started with changed training keys
and no `run_dir` lives in `<config name>-<hash>` (rebm.config.identity.default_run_dir), so the
path a README or a script spells out is often one such sibling away."""

from __future__ import annotations

import os

from rebm.checkpoint.run_directory import RunDirectory, sibling_runs
from rebm.checkpoint.weights import CheckpointError
from rebm.config.schema import ModelConfig
from rebm.config.sections import RunSection

FINAL_MODEL = RunDirectory.FINAL_MODEL


def model_file(path: str, key: str = "model.ckpt_path") -> str:
    """The weights file `path` (the config key `key`) stands for: the file itself, or a run
    directory's model_final.pth. CheckpointError in one line otherwise: an unfinished run names
    its newest training state, a missing path the runs of the same config beside it."""
    if os.path.isdir(path):
        final = RunDirectory(path).final_model
        if os.path.isfile(final):
            return final
        states = RunDirectory(path).states()
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


def check_starting_weights(model: ModelConfig, run: RunSection) -> None:
    """CheckpointError (one line, `model_file`'s) when a new run's `model.ckpt_path` does not
    exist. A run directory holding training states resumes from them and does not read the file
    (it may have moved since), so it is not checked then. Called before the run directory is
    created: a typo leaves nothing behind."""
    path = model.ckpt_path
    if not path or os.path.exists(path):
        return
    if run.run_dir and os.path.isdir(run.run_dir) and RunDirectory(run.run_dir).states():
        return
    model_file(path)
