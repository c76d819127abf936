"""Training states of the first layout (format 1), read into today's (format 2).

Serves: resuming runs whose states were written before the state was split into parts (one flat
dict, the method's fields merged in: DAT's `curriculum`, stage 1's `schedule` and `last_step`),
including stage-1 states written before the engine, whose metrics window was a list
[loss sum, correct, images] (tests/data_states holds one state of each stage).
rebm/checkpoint/state.py calls `upgrade_format1` on every state without a format >= 2.
"""

from __future__ import annotations

from typing import Any, Dict

FORMAT2 = 2  # the layout upgrade_format1 returns
# The fields of a format-1 state (today's top-level keys -> part) that are not the method's.
_FORMAT1_PROGRESS = ("best", "metrics_window", "eval_pending")
_FORMAT1_OWN = ("stage", "step", "world_size", "config", "model", "optimizer", "ema", "scaler",
                "rng", "scheduler", "wandb_run_id", *_FORMAT1_PROGRESS)
_STAGE1_LIST_WINDOW = ("clf_sum", "correct", "images")  # stage 1 before the engine


def _metrics_window(saved: Any) -> Dict[str, float]:
    if isinstance(saved, list):
        return dict(zip(_STAGE1_LIST_WINDOW, saved, strict=True))
    return dict(saved or {})


def upgrade_format1(state: Dict[str, Any]) -> Dict[str, Any]:
    """A format-1 state in the format-2 layout (parts under their own keys)."""
    upgraded = {key: state[key] for key in ("stage", "step", "world_size", "config",
                                            "model", "optimizer", "scaler", "rng")
                if key in state}
    upgraded["format"] = FORMAT2
    for key in ("ema", "scheduler"):
        if state.get(key) is not None:
            upgraded[key] = state[key]
    upgraded["method"] = {k: v for k, v in state.items() if k not in _FORMAT1_OWN}
    upgraded["progress"] = {"best": dict(state.get("best", {})),
                            "metrics_window": _metrics_window(state.get("metrics_window")),
                            "eval_pending": bool(state.get("eval_pending", False))}
    upgraded["tracker"] = {"wandb_run_id": state.get("wandb_run_id")}
    return upgraded
