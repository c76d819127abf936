"""The learning-rate schedule section: `lr_schedule` and `fixed_lr`, and the rules of each stage.

Stage 1 (adversarial training, rebm.methods.at) follows a cosine to 0 over the run by default
(the In-N-Out recipe), or a constant rate; stage 2 (DAT) trains at a constant rate, which the
original DAT code enforces with `fixed_lr: true`. `lr_schedule` is a training key: it is written
to config.yaml, and resuming a run with another value is refused (rebm/config/identity.py).
`null` means the stage's own default, so a stage-2 config of the original schema loads as before.
"""

from __future__ import annotations

from typing import Any

from rebm.config.errors import ConfigError

LR_SCHEDULES = ("cosine", "constant")
# the schedules each stage offers, its default first
STAGE_SCHEDULES = {1: ("cosine", "constant"), 2: ("constant",)}


def check_lr_schedule_value(cfg: Any, source: str) -> None:
    """At load (no stage known yet): `lr_schedule` is null or a schedule rebm has."""
    if cfg.lr_schedule is not None and cfg.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"{source}: 'lr_schedule: {cfg.lr_schedule}' is not a valid choice; "
                          f"use one of {', '.join(LR_SCHEDULES)} (or null: the stage's default)")


def check_stage_schedule(cfg: Any, stage: int, source: str = "config") -> None:
    """The schedule rules of `stage`, checked by its entry point: stage 2 (DAT) needs a constant
    rate (`fixed_lr: true`, as the original requires, and no other lr_schedule); stage 1 reads
    `lr_schedule` and not `fixed_lr`."""
    allowed = STAGE_SCHEDULES[stage]
    if cfg.lr_schedule is not None and cfg.lr_schedule not in allowed:
        raise ConfigError(f"{source}: 'lr_schedule: {cfg.lr_schedule}' is not offered in stage "
                          f"{stage}; use {' or '.join(allowed)} (or null)")
    if stage == 2 and not cfg.fixed_lr:
        raise ConfigError(f"{source}: 'fixed_lr: false' is not supported in stage 2 (DAT uses a "
                          "constant learning rate); set fixed_lr: true")


def stage_lr_schedule(cfg: Any, stage: int) -> str:
    """The schedule a run of `stage` follows: `lr_schedule`, or the stage's default when null."""
    return cfg.lr_schedule or STAGE_SCHEDULES[stage][0]
