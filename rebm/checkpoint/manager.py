"""What a run saves into its run directory, and when (after torchtitan's CheckpointManager): the
training states (written atomically at their interval, the newest few kept), the state a run
resumes from, the best models and the final model. Rank 0 writes; a method ending in
`_all_ranks` tells every rank the outcome, so a full disk stops all ranks with the same error
instead of a hang. The file names are the RunDirectory's; a state's layout is
rebm.checkpoint.state's."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from rebm.checkpoint.run_directory import RunDirectory, state_step
from rebm.checkpoint.state import (
    StateError,
    StateOfAnotherRun,
    StateUnreadable,
    check_finite_weights,
    check_state_file,
    read_state,
)
from rebm.checkpoint.weights import atomic_torch_save, save_model
from rebm.config.batch import BatchPlan
from rebm.distributed import Runtime, consensus, decide_on_main
from rebm.distributed.collectives import on_every_rank, on_main

LOGGER = logging.getLogger("rebm")


StateCheck = Callable[[Dict[str, Any]], None]  # raises StateError when a state does not fit


def trusted(path: str, fits: Optional[StateCheck] = None) -> Dict[str, Any]:
    """The state in `path`, verified (`check_state_file`: the zip's CRC-32s, before torch.load
    reads anything of a damaged file), read, its weights finite and, given `fits`, checked
    against the run (StateError otherwise; StateUnreadable when the file cannot be read)."""
    check_state_file(path)
    state = read_state(path)
    check_finite_weights(path, state)
    if fits is not None:
        fits(state | {"_path": path})
    return state


class CheckpointManager:
    """The training states and model files of the run in `run_directory`: a state every
    `interval_imgs` images (None: only at the end and on a preemption), the newest `keep_last`
    kept."""

    def __init__(self, run_directory: RunDirectory, runtime: Runtime, keep_last: int,
                 interval_imgs: Optional[int] = None):
        self.run_directory = run_directory
        self.runtime = runtime
        self.keep_last = keep_last
        self.interval_imgs = interval_imgs

    def save_due(self, plan: BatchPlan, step: int, last_step: float) -> bool:
        """A state is saved after optimizer step `step` (the last step saves at the end)."""
        return plan.crossed(self.interval_imgs, step) and step < last_step

    def write_state(self, state: Dict[str, Any]) -> str:
        """Write atomically (temp file + os.replace), then prune all but the newest `keep_last`.
        A failed write raises StateError and leaves earlier states untouched."""
        run_directory = self.run_directory
        path = run_directory.state_file(int(state["step"]))
        try:
            os.makedirs(run_directory.states_dir, exist_ok=True)
            atomic_torch_save(state, path)
        except OSError as err:  # WriteError: torch.save's RuntimeError on a full disk too
            previous = run_directory.states()
            raise StateError(
                f"cannot write training state '{path}' ({err.strerror or err}); free disk space "
                f"or fix permissions of '{run_directory.states_dir}'. Previous state "
                f"{'%r is intact' % previous[0] if previous else 'none exists'}"
            ) from None
        for old in run_directory.states()[self.keep_last:]:
            try:
                os.remove(old)
            except OSError:
                pass
        return path

    def save_state_all_ranks(self, build_state: Callable[[], Dict[str, Any]]) -> None:
        """Rank 0 builds and writes the state; then every rank learns whether the write worked
        (a consensus). Every rank must call this."""
        failure: Optional[str] = None
        if self.runtime.is_main:
            try:
                self.write_state(build_state())
            except StateError as err:
                failure = str(err)
        if consensus(self.runtime, failed=failure is not None)["failed"]:
            raise StateError(failure or "rank 0 could not write the training state (see its log)")

    def find_resumable(self, explicit: Optional[str], auto: bool = True,
                       fits: Optional[StateCheck] = None) -> Optional[Tuple]:
        """(path, state) of the newest trusted state: the explicit path if given (a state
        file, a run directory or its checkpoints/), else (when `auto`) the newest in the run's
        checkpoints/, skipping (with a warning) any that is unreadable, damaged, not finite or
        does not fit (`trusted`)."""
        if explicit:
            target = explicit
            if os.path.isdir(explicit):
                candidates = (RunDirectory(explicit).states()
                              or RunDirectory(os.path.dirname(explicit)).states())
                if not candidates:
                    raise StateError(f"resume_from_state '{explicit}' holds no state_*.pt files")
                target = candidates[0]
            return target, trusted(target, fits)
        if not auto:
            return None
        candidates = self.run_directory.states()
        for path in candidates:
            try:
                return path, trusted(path, fits)
            except (StateOfAnotherRun, StateUnreadable):
                raise  # no older state is better; an unreadable one is not proven damaged
            except StateError as err:
                LOGGER.warning("%s; trying the previous state (set aside as %s)", err,
                               _set_aside(path))
        if candidates:
            raise StateError(
                f"none of the {len(candidates)} training states in "
                f"'{self.run_directory.states_dir}' is usable (see the lines above; each is kept "
                f"as state_<step>.pt{RunDirectory.SET_ASIDE}); pass resume=never to start afresh, "
                "or resume_from_state=PATH"
            )
        self.refuse_behind_set_aside()
        return None

    def refuse_behind_set_aside(self) -> None:
        """StateError when the run has no usable state but states set aside as damaged: starting
        afresh would put the run behind them, which only resume=never asks for (a plain rerun,
        or torchrun's restart after the run stopped on them, must not)."""
        aside = self.run_directory.set_aside_states()
        if aside:
            names = ", ".join(os.path.basename(path) for path in aside[:3])
            more = f" and {len(aside) - 3} more" if len(aside) > 3 else ""
            raise StateError(
                f"'{self.run_directory.states_dir}' holds only training states set aside as "
                f"damaged ({names}{more}); the run does not start afresh behind them: pass "
                f"resume=never to start afresh anyway (they are kept), or rename one back "
                f"(without {RunDirectory.SET_ASIDE}) to try it again")

    def resume_state_all_ranks(self, explicit: Optional[str], allow_auto: bool,
                               fits: Optional[StateCheck] = None) -> Optional[Dict[str, Any]]:
        """Rank 0 picks the state to resume from (or none), checked by `trusted` (`fits`: the
        run's own check that a state fits its parts); every rank then loads that same file (its
        path under "_path"). Called by every rank: the decision is a broadcast."""
        def choose() -> Optional[str]:
            found = self.find_resumable(explicit, auto=allow_auto, fits=fits)
            if allow_auto and not explicit:
                return found[0] if found else None  # the newest usable state: none is newer
            # resume=never or an explicit state: the run must not start behind run_dir's states
            # (saving would prune the new states, and a later auto-resume would jump to the old).
            start = int(found[1]["step"]) if found else 0
            newer = [p for p in self.run_directory.states() if state_step(p) > start]
            if newer:
                raise StateError(
                    f"'{self.run_directory.states_dir}' holds states of a later step than this "
                    f"run starts from (newest: {os.path.basename(newer[0])}); use a new run_dir, "
                    "or move them away")
            return found[0] if found else None

        chosen = decide_on_main(self.runtime, choose)
        if chosen is None:
            return None
        # every rank reads the file itself: one that cannot stops every rank, in one line
        state = on_every_rank(self.runtime, lambda: read_state(chosen), f"read '{chosen}'")
        return state | {"_path": chosen}

    def keep_best_all_ranks(self, model: torch.nn.Module, best: Dict[str, float],
                            results: Dict[str, Any], robust_eval: bool) -> None:
        """model_bestacc.pth (robust accuracy, clean without robust_eval) and model_bestfid.pth,
        written by rank 0 when an evaluation beats the best so far (`best`, updated)."""
        for metric, filename, higher_is_better in (
            ("robust_test_acc" if robust_eval else "test_acc", RunDirectory.BEST_ACC_MODEL, True),
            ("fid", RunDirectory.BEST_FID_MODEL, False),
        ):
            value = results.get(metric)
            if value is None:
                continue
            previous = best.get(metric)
            if previous is None or (value > previous if higher_is_better else value < previous):
                best[metric] = value
                path = self.run_directory.file(filename)
                on_main(self.runtime, lambda p=path: save_model(model, p), f"write {path}")

    def finished_all_ranks(self) -> bool:
        """The run has its model_final.pth (rank 0 looks; every rank learns it)."""
        return decide_on_main(self.runtime, lambda: os.path.exists(self.run_directory.final_model))

    def save_final_all_ranks(self, model: torch.nn.Module) -> str:
        """model_final.pth, a plain state dict (it loads as model.ckpt_path of the next stage),
        written by rank 0."""
        path = self.run_directory.final_model
        on_main(self.runtime, lambda: save_model(model, path), f"write {path}")
        return path


def _set_aside(path: str) -> str:
    """Rename an unusable state out of the state_*.pt names (nothing is deleted): left among
    them, it would count among the newest `keep_last_states` and the pruning after the next
    save would delete the good states older than it. The new name, or the old one when the
    rename fails (a read-only folder: then nothing is written there either)."""
    aside = path + RunDirectory.SET_ASIDE
    try:
        os.replace(path, aside)
    except OSError:
        return path
    return aside
