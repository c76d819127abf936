"""Each training stage's rules, owned by its method (rebm.methods.at: stage 1, rebm.methods.dat:
stage 2) and checked on every path into it (`Method.check_config`, which the entry points' and
`--check`'s start runs): the learning-rate schedules the stage offers, its default first, and its
own config rules.

Stage 1 follows a cosine to 0 over the run by default (the In-N-Out recipe), or a constant rate,
and trains BatchNorm live; stage 2 (DAT) trains at a constant rate, which the original DAT code
enforces with `fixed_lr: true`. The config layer only checks that `lr_schedule` names a schedule
rebm has (rebm/config/schedule.py). Torch-free, so an entry point's parser offers the schedules
without importing torch (`--help`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple

from rebm.config import ConfigError
from rebm.config.sections import ScheduleSection


@dataclass(frozen=True)
class Stage:
    number: int
    schedules: Tuple[str, ...]  # the values of lr_schedule it offers, its default first

    def lr_schedule(self, schedule: ScheduleSection) -> str:
        """The schedule a run of this stage follows: `lr_schedule`, or the default when null."""
        return schedule.lr_schedule or self.schedules[0]

    def check(self, schedule: ScheduleSection, model: Any, source: str = "config") -> None:
        """ConfigError naming the key (and `source`, the config file) when the schedule or the
        model section (ModelConfig) breaks a rule of this stage."""
        if schedule.lr_schedule is not None and schedule.lr_schedule not in self.schedules:
            raise ConfigError(f"{source}: 'lr_schedule: {schedule.lr_schedule}' is not offered in "
                              f"stage {self.number}; use {' or '.join(self.schedules)} (or null)")
        if self.number == 1 and not model.use_batchnorm:
            raise ConfigError("stage 1 trains BatchNorm live: set model.use_batchnorm=true")
        if self.number == 2 and not schedule.fixed_lr:
            raise ConfigError(f"{source}: 'fixed_lr: false' is not supported in stage 2 (DAT "
                              "uses a constant learning rate); set fixed_lr: true")


STAGE1 = Stage(1, ("cosine", "constant"))  # adversarial training (rebm.methods.at)
STAGE2 = Stage(2, ("constant",))  # DAT (rebm.methods.dat)
