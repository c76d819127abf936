"""What every evaluation metric is made of: the evaluation spec, the metric base class, and the
two kinds of input a metric is fed (docs/evaluation.md, "Adding a metric").

Adding a metric is one module plus one registration:

1. In a module of its own under rebm/eval/metrics/, subclass `Metric`:
   - `name`: the registry name (what `--metrics` / `eval.metrics` / an Evaluator's metrics say);
   - `source`: `TEST_SET` (fed every `TestBatch` of this rank's shard of the test set, in one
     pass shared by all such metrics) or `SAMPLES` (fed every `SampleChunk` of this rank's
     generated samples, in one generation pass shared by all such metrics);
   - `settings(evaluation)`: a JSON-able dict of everything that decides the value (attack,
     number of images, feature network, ...), from the evaluation section (`cfg.evaluation`,
     rebm/config/sections.py). It is written to eval.json next to the value and can serve as a
     cache key, so it must depend on the section (and environment) only;
   - `build(evaluation, runtime, resources)` (optional): load once per run what every
     evaluation reuses (a feature network, reference statistics); `problems(evaluation)`: what
     this machine lacks;
   - `__init__(ctx)` (cheap: no collective, no generation), `start_all_ranks()` (optional:
     collective preparation, e.g. reference features), `update(batch_or_chunk)`: keep only what
     the value needs (counts, feature sums, feature rows), never the images; no collective;
   - `finish_all_ranks()`: combine the ranks (every rank calls it; collectives go here) and
     return the same {key: value} dict on every rank;
   - `describe(results, settings)`: the console table's rows for it; `outputs()`: the files
     it wrote;
   - `summary` (optional): its values in the one-line summary of the training log and of
     `python -m rebm.eval.evaluate` (rebm/eval/results.py); by default the value under its name.
2. Add the class to `METRICS` in rebm/eval/registry.py.

Every rank builds the same metrics in the same order and feeds them its own shard, so a metric's
collectives line up on all ranks. Results must not depend on the world size: test images are
sharded by dataset index, samples by index chunk (rebm/eval/sampling/samples.py), and per-rank state is
combined by sums or by index-ordered gathers.

Sums of floats go through `ExactSums` (rebm/eval/exact_sums.py, beside this module): float64
running sums added per rank come out in another order on another world size, and move the value
by round-off; exact sums give the same bits on any world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from rebm.checkpoint.run_directory import RunDirectory
from rebm.config.evaluation import SAMPLE_PIXELS
from rebm.config.views import EvaluationSection
from rebm.distributed import Runtime
from rebm.errors import UserError

TEST_SET = "test set"
SAMPLES = "samples"

# One value of an evaluation's one-line summary: (results key, short label, format string).
SummaryValue = Tuple[str, str, str]


class EvalError(UserError, ValueError):
    """The evaluation cannot start (no checkpoint, an unknown metric, a bad ids file, what a
    metric needs and this machine lacks); one line."""


@dataclass
class EvalContext:
    """What a metric instance gets from the Evaluator (rebm/eval/evaluator.py): the unwrapped
    model (in eval mode while the evaluation runs), the metric's evaluation section
    (`cfg.evaluation`, rebm/config/sections.py), this rank's runtime,
    the images per rank and batch, the folder for files (the run directory's paths: sample grid,
    PNGs, npz, diagrams; None: no files) and the training step (names the files; None: an evaluation of a checkpoint).
    `resources` are the Evaluator's, kept for the whole run: the feature networks and
    reference statistics `Metric.build` made at start, the reference features a metric computes
    once (`shared`)."""

    model: nn.Module
    evaluation: EvaluationSection
    runtime: Runtime
    batch_size: int
    run_dir: Optional[RunDirectory] = None
    step: Optional[int] = None
    resources: Dict[str, Any] = field(default_factory=dict)

    def shared(self, key: str, build: Callable[[], Any]) -> Any:
        """The resource `key`, built by `build()` the first time any metric of the run asks."""
        if key not in self.resources:
            self.resources[key] = build()
        return self.resources[key]


class TestBatch:
    """One batch of this rank's test shard: images x (on the device), labels y, dataset indices
    (cpu), and where the images sit in the evaluation's list of `n_images` test images
    (`positions`, cpu; the original evaluated that list in order, in batches of its own).
    `logits()` is the clean forward, computed once for all metrics that need it."""

    def __init__(self, model: nn.Module, x: Tensor, y: Tensor, index: Tensor, positions: Tensor,
                 n_images: int):
        self.model, self.x, self.y, self.index = model, x, y, index
        self.positions, self.n_images = positions, n_images
        self._logits: Optional[Tensor] = None

    def logits(self) -> Tensor:
        if self._logits is None:
            with torch.no_grad():
                self._logits = self.model(self.x)
        return self._logits


class SampleChunk:
    """One chunk of this rank's generated samples: sample indices (cpu int64), labels, images
    (float [0, 1], on the device) and the seeds they started from (the same rows, as the PGD
    ascent got them, after any blur: the seed grid shows them). `pixels()` are the 8-bit values
    a PNG of the sample holds (uint8 NCHW), by `pixel_mode` (`eval.sample_pixels`, see
    `to_pixels`): every sample metric and file sees the same values. `cached(key, compute)` computes a value (e.g. one feature
    network's features) once per chunk for every metric that asks."""

    def __init__(self, indices: Tensor, labels: Tensor, images: Tensor, seeds: Tensor,
                 pixel_mode: str = "floor"):
        self.indices, self.labels, self.images, self.seeds = indices, labels, images, seeds
        self.pixel_mode = pixel_mode
        self._cache: Dict[str, Any] = {}

    def pixels(self) -> Tensor:
        return self.cached("pixels", lambda: to_pixels(self.images, self.pixel_mode))

    def cached(self, key: str, compute: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]


def to_pixels(images: Tensor, mode: str = "floor") -> Tensor:
    """float [0, 1] images as uint8, the values a PNG of them holds.

    - "floor": floor(255 x), what torchvision's `to_pil_image` of a float tensor writes (it
      multiplies by 255 in float32 and casts to uint8, which truncates): the original DAT code's
      sample PNGs. Values are clamped to [0, 1] first (the cast is undefined outside [0, 256)).
    - "round": floor(255 x + 0.5), clamped, what torchvision's `save_image` writes.
    Both give back k exactly for the 8-bit images k / 255 (float32), so real images read from
    8-bit files are unchanged by either."""
    x = images.detach().float()
    if mode == "floor":
        return x.clamp(0, 1).mul(255).to(torch.uint8)
    if mode == "round":
        return x.mul(255).add(0.5).clamp(0, 255).to(torch.uint8)
    raise ValueError(f"pixel mode '{mode}' is not one of {', '.join(SAMPLE_PIXELS)}")


class Metric:
    """Base of every registered metric (see the module docstring)."""

    name: ClassVar[str] = ""
    source: ClassVar[str] = TEST_SET
    # Bumped whenever the way the value is computed changes, so that cached values computed
    # the old way (the table runner's cache) are recomputed.
    protocol: ClassVar[int] = 1
    # The metric's values in the one-line summary (`summary_values`), each (results key, short
    # label, format), e.g. ("fid", "FID", "{:.2f}"); () for none. None (the default) shows the
    # value under the metric's own name, labelled by it, so that a new metric is in the summary
    # without declaring anything.
    summary: ClassVar[Optional[Tuple[SummaryValue, ...]]] = None

    def __init__(self, ctx: EvalContext):
        self.ctx = ctx

    @classmethod
    def settings(cls, evaluation: EvaluationSection) -> Dict[str, Any]:
        """Everything that decides the value, JSON-able (eval.json, cache keys)."""
        return {}

    @classmethod
    def files(cls, evaluation: EvaluationSection) -> Dict[str, Optional[str]]:
        """The files and folders the value is computed from, other than the checkpoint:
        {what it is (a config key, e.g. 'image_log.data_dir'): path}. Files are hashed into
        cache keys (a rewritten statistics file recomputes the value) and listed, present or
        missing, by `rebm.eval.table --check`; folders (dataset roots) count by path."""
        return {}

    @classmethod
    def problems(cls, evaluation: EvaluationSection) -> List[str]:
        """What this machine lacks for the metric (files, packages), one line each; checked
        before any work (`--check` prints them as warnings)."""
        return []

    @classmethod
    def build(cls, evaluation: EvaluationSection, runtime: Runtime,
              resources: Dict[str, Any]) -> None:
        """Put into `resources` what every evaluation of this metric reuses (feature networks,
        reference statistics), under keys that name what they depend on; called once per
        Evaluator at start, on every rank, after `problems` found nothing. Rank-local (no
        collective): a missing or broken file raises its one-line error here."""

    def start_all_ranks(self) -> None:
        """Before this evaluation's pass, on every rank: work with collectives that the pass
        needs (the real images' features of precision/recall, kept in `ctx.resources` for the
        next evaluations)."""

    def generation_steps_all_ranks(self) -> Optional[int]:
        """SAMPLES metrics: a PGD step count chosen before the generation pass (FID's adaptive
        sweep, which generates), else None (image_log.num_steps). Every rank calls this."""
        return None

    def outputs(self) -> Dict[str, str]:
        """The files this evaluation wrote, {what: path} (the same on every rank), after
        `finish_all_ranks`: e.g. the sample grid."""
        return {}

    def update(self, item) -> None:
        """Take one TestBatch (TEST_SET) or SampleChunk (SAMPLES) of this rank."""

    def finish_all_ranks(self) -> Dict[str, Any]:
        """Every rank: combine the ranks, return {key: value} (the same on every rank)."""
        return {}

    @classmethod
    def describe(cls, results: Dict[str, Any], settings: Dict[str, Any]) -> List[Tuple[str, str, str]]:
        """Console rows (label, value, settings text) for this metric's results."""
        return []

    @classmethod
    def summary_values(cls) -> Tuple[SummaryValue, ...]:
        """(results key, label, format) of each value the one-line summary shows. A value that a
        feature network other than the verified Inception computed, under `<key>_unverified` or
        `<key>_standin`, is shown too, labelled as such (rebm/eval/results.py)."""
        if cls.summary is None:
            return ((cls.name, cls.name, "{:.4g}"),)
        return cls.summary
