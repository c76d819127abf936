"""Views: what a component reads of several sections. A view holds references to the config's
stored sections (rebm/config/sections.py, schema.py) and no key of its own, so no key is
declared twice; two views of equal sections are equal. Importing this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class InputSection:
    """The training and evaluation data: the datasets and their augmentations (`data`), the
    seed and the global batch that order them (`schedule`)."""

    data: Any  # DataConfig
    schedule: Any  # ScheduleSection


@dataclass(frozen=True)
class EvaluationSection:
    """What an evaluation reads: its own section (`eval`), generation (`image_log`), the data it
    tests on, the model, the method (robust accuracy's attack, the energies the samples ascend),
    the batches and the seed (`schedule`) and whether the EMA is evaluated."""

    eval: Any  # EvalConfig
    image_log: Any  # ImageLogConfig
    data: Any  # DataConfig
    model: Any  # ModelConfig
    method: Any  # MethodSection
    schedule: Any  # ScheduleSection
    ema: Any  # EmaSection

    @property
    def inputs(self) -> InputSection:
        """The out-distribution's loaders (OOD detection's training out-dist)."""
        return InputSection(data=self.data, schedule=self.schedule)


@dataclass(frozen=True)
class NetworkSection:
    """What a training run's network is built from: its section, the data's classes and image
    size, and the hardware it runs on (precision, SyncBatchNorm, DDP's options)."""

    model: Any  # ModelConfig
    data: Any  # DataConfig
    distributed: Any  # DistributedSection
