"""Procedural out-distributions: uniform noise (`noise` is the original's name) and
low-frequency noise (8x8 at 32 px, bilinearly upsampled), seeded by rand_seed per image."""

from __future__ import annotations

from typing import Optional

from rebm.config.datasets import outdist
from rebm.config.views import InputSection
from rebm.data.sources import DEFAULT_NOISE_LENGTH, NoiseSource


@outdist("lowfreq-noise", reads_files=False)
@outdist("uniform-noise", reads_files=False)
@outdist("noise", reads_files=False)
def noise(inputs: InputSection, length: Optional[int]) -> NoiseSource:
    size = inputs.data.image_size
    low_res = max(1, size // 4) if inputs.data.outdist_dataset == "lowfreq-noise" else None
    return NoiseSource(length or DEFAULT_NOISE_LENGTH, size, inputs.schedule.rand_seed, low_res)
