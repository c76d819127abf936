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

from dataclasses import dataclass, fields
from typing import Any, Iterable, List, Tuple

from rebm.config import ConfigError
from rebm.config.origins import BUILT_IN_CODE, ConfigOrigins
from rebm.config.sections import MethodSection, ScheduleSection

# The method keys only DAT (stage 2) reads: stage 1 reads only its classifier attack of the
# method section, so a new method key is stage 2's unless added here (tests/test_fields_read.py
# checks both lists against what each stage reads).
STAGE1_METHOD_KEYS = ("indist_attack_clf",)
DAT_ONLY_KEYS = tuple(f.name for f in fields(MethodSection) if f.name not in STAGE1_METHOD_KEYS)


@dataclass(frozen=True)
class Stage:
    number: int
    schedules: Tuple[str, ...]  # the values of lr_schedule it offers, its default first
    unread: Tuple[str, ...] = ()  # top-level keys the other stage's method reads and this not

    def unread_keys_set(self, explicit: Iterable[str]) -> List[str]:
        """The keys of `explicit` (the config's explicit_keys) that this stage does not read, the
        most specific ones (`attack.max_steps`, not also `attack`), in their order."""
        keys = [key for key in explicit if key.split(".")[0] in self.unread]
        return [key for key in keys if not any(o.startswith(key + ".") for o in keys)]

    def lr_schedule(self, schedule: ScheduleSection) -> str:
        """The schedule a run of this stage follows: `lr_schedule`, or the default when null."""
        return schedule.lr_schedule or self.schedules[0]

    def check(self, schedule: ScheduleSection, model: Any,
              origins: ConfigOrigins = BUILT_IN_CODE) -> None:
        """ConfigError naming the key and where it was set (`origins`: the command line or the
        config file) when the schedule or the model section (ModelConfig) breaks a rule of this
        stage."""
        if schedule.lr_schedule is not None and schedule.lr_schedule not in self.schedules:
            raise ConfigError(f"{origins.of('lr_schedule')}: 'lr_schedule: "
                              f"{schedule.lr_schedule}' is not offered in stage {self.number}; "
                              f"use {' or '.join(self.schedules)} (or null)")
        if self.number == 1 and not model.use_batchnorm:
            raise ConfigError(f"{origins.of('model.use_batchnorm')}: stage 1 trains BatchNorm "
                              "live: set model.use_batchnorm=true")
        if self.number == 2 and not schedule.fixed_lr:
            raise ConfigError(f"{origins.of('fixed_lr')}: 'fixed_lr: false' is not supported in "
                              "stage 2 (DAT uses a constant learning rate); set fixed_lr: true")


STAGE1 = Stage(1, ("cosine", "constant"), DAT_ONLY_KEYS)  # adversarial training (methods.at)
STAGE2 = Stage(2, ("constant",))  # DAT (rebm.methods.dat)
