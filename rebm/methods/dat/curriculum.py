"""DAT's out-distribution attack curriculum (docs/design.md §1, step 5).

The method feeds `Curriculum.update` the AUC of the *global* batch (the same number on every
rank), so every rank takes the same decision without a collective here.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Dict, Optional

from rebm.config.sections import MethodSection


class Curriculum:
    """Number T of PGD steps for the negatives, raised while the model separates them well.

    Window mode (default): keep the AUCs of the last `window_size` steps; when the window is full
    and its mean >= `auc_threshold`, T <- T + 1 and the window starts empty. With
    `samples_per_attack_step`, T instead rises after that many images at the current T. T never
    exceeds `max_T` (`attack.max_steps`).
    """

    def __init__(
        self,
        start_step: int,
        max_T: int,
        auc_threshold: float,
        window_size: int,
        samples_per_attack_step: Optional[int] = None,
    ):
        if window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {window_size}")
        if not 0 <= start_step <= max_T:
            raise ValueError(f"need 0 <= start_step ({start_step}) <= max_T ({max_T})")
        self.start_step = start_step  # attack.start_step: T of a new curriculum
        self.T = start_step
        self.max_T = max_T  # attack.max_steps: the cap on T
        self.auc_threshold = auc_threshold
        self.samples_per_attack_step = samples_per_attack_step
        self.window: deque = deque(maxlen=window_size)
        self.images_at_T = 0

    @classmethod
    def from_config(cls, method: MethodSection, batch_size: int) -> "Curriculum":
        """From the config's method section: window = ceil(min_imgs_per_threshold / global
        batch_size) steps."""
        return cls(
            start_step=method.attack.start_step,
            max_T=method.attack.max_steps,
            auc_threshold=method.AUC_th,
            window_size=math.ceil(method.min_imgs_per_threshold / batch_size),
            samples_per_attack_step=method.samples_per_attack_step,
        )

    @property
    def window_mean(self) -> float:
        return sum(self.window) / len(self.window) if self.window else math.nan

    def update(self, adv_auc: float, n_images: int) -> bool:
        """Record one optimizer step (its AUC and global image count); True when T advanced."""
        self.window.append(float(adv_auc))
        self.images_at_T += int(n_images)
        if self.T >= self.max_T:
            return False
        if self.samples_per_attack_step:
            advance = self.images_at_T >= self.samples_per_attack_step
        else:
            advance = (
                len(self.window) == self.window.maxlen and self.window_mean >= self.auc_threshold
            )
        if advance:
            self.T += 1
            self.window.clear()
            self.images_at_T = 0
        return advance

    def state_dict(self) -> Dict[str, Any]:
        return {"T": self.T, "window": list(self.window), "images_at_T": self.images_at_T}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue the saved curriculum under this run's settings: its threshold and window
        length are the config's (a shorter window keeps the newest AUCs), and T stays within
        this run's [start_step, max_T]: T only rises, so a run resumed with its own settings
        continues its T, and under resume=force a raised attack.start_step lifts T to it, a
        lowered attack.max_steps caps it."""
        self.T = min(max(int(state["T"]), self.start_step), self.max_T)
        self.window.clear()
        self.window.extend(float(a) for a in state["window"])  # keeps the newest if maxlen shrank
        self.images_at_T = int(state["images_at_T"])
