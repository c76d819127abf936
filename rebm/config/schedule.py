"""The learning-rate schedule keys `lr_schedule` and `fixed_lr`, checked at load as far as no
stage is known: `lr_schedule` names a schedule rebm has. Which schedules a stage offers, its
default and `fixed_lr`'s rule belong to the methods (rebm/methods/stages.py). `lr_schedule` is a
training key: it is written to config.yaml, and resuming a run with another value is refused
(rebm/config/identity.py). `null` means the stage's own default, so a stage-2 config of the
original schema loads as before.
"""

from __future__ import annotations

from typing import Optional

from rebm.config.errors import ConfigError
from rebm.registry import choice_message

LR_SCHEDULES = ("cosine", "constant")


def check_lr_schedule_value(lr_schedule: Optional[str], source: str) -> None:
    """At load (no stage known yet): `lr_schedule` is null or a schedule rebm has."""
    if lr_schedule is not None and lr_schedule not in LR_SCHEDULES:
        raise ConfigError(choice_message("lr_schedule", lr_schedule, LR_SCHEDULES, source)
                          + " (or null: the stage's default)")
