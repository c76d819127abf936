"""When the training loop's interval events fire: metrics logs, image previews, evaluations.

Intervals are counted in images, and an interval is crossed by optimizer step k (counted from 1)
when the global image counter passes a multiple of it during k (`BatchPlan.crossed`). Two loops
place their events differently around that crossing, and a method says which it follows
(`Method.events_at_step_start`):

- **At the start of the step (the original DAT loop).** Its trigger fires for step k when k is
  the first step or crosses the interval, and the loop evaluates at the start of step k, before
  k's update: on the model after k - 1 updates, the starting model included. Its metrics and
  image logs use the same trigger but run after k's update, with k's numbers. Its loop ends
  before the step after its last, so it never evaluated its last model: a final evaluation rebm
  adds is a report, not a candidate for the best models (unless that next step would have
  evaluated first).
- **After the step (In-N-Out's stage-1 loop, which tests after training).** Every event of step k
  runs after k's update, when k crosses its interval; the final evaluation is a candidate.

`step` below is always the number of updates done when the event runs, which is what
metrics.jsonl records: the original's evaluation at the start of step k is rebm's record at step
k - 1 (0 for the starting model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rebm.config.batch import BatchPlan
from rebm.config.sections import IntervalSection


@dataclass(frozen=True)
class EventSchedule:
    """The loop's events for one run: its batch plan, its intervals, the method's placement of
    them and the step the run trains to."""

    plan: BatchPlan
    intervals: IntervalSection
    at_step_start: bool  # Method.events_at_step_start
    last_step: float
    log_final_step: bool = False  # Method.log_final_step: also log after the last update

    def _fires(self, interval_imgs: Optional[int], step: int) -> bool:
        """The trigger of optimizer step `step` (from 1) for an interval of `interval_imgs`."""
        if not interval_imgs:
            return False
        return (self.at_step_start and step == 1) or self.plan.crossed(interval_imgs, step)

    def log_due(self, step: int) -> bool:
        """Training metrics are logged after update `step`."""
        return (self._fires(self.intervals.n_imgs_per_metrics_log, step)
                or (self.log_final_step and step == self.last_step))

    def previews_due(self, step: int) -> bool:
        """The method's image grids are saved after update `step`."""
        return self._fires(self.intervals.n_imgs_per_image_log, step)

    def evaluation_due(self, step: int) -> bool:
        """An evaluation runs once `step` updates are done (0: the starting model): at the start
        of step `step` + 1 in the original DAT loop, after update `step` otherwise."""
        interval = self.intervals.n_imgs_per_evaluation_log
        if self.at_step_start:
            return step < self.last_step and self._fires(interval, step + 1)
        return step > 0 and self._fires(interval, step)

    def final_evaluation_is_candidate(self, step: int) -> bool:
        """Whether the evaluation after the last update `step` (run when no interval put one
        there) may write the best models. The original DAT loop never evaluated its last model,
        except as the first thing of the next step when that step crosses the interval: then
        the final evaluation is that one, and a run continued past `step` (a larger max_steps)
        has nothing left to evaluate at `step`."""
        if not self.at_step_start:
            return True
        return self._fires(self.intervals.n_imgs_per_evaluation_log, step + 1)
