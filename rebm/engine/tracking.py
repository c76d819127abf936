"""What a run writes for people to read (docs/design.md §4): config.yaml, metrics.jsonl, wandb,
PNG grids. Only rank 0 writes, but every rank calls every method. The `*_all_ranks` methods
write through `on_main`, so a failed write (full disk, wandb error) stops every rank with rank
0's one-line error instead of leaving the others waiting in their next collective; the training
record of a metrics log (`log_training`) runs no collective, and its failure rides on the loop's
next consensus."""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from rebm.checkpoint.run_directory import RunDirectory
from rebm.config import yaml_of
from rebm.config.sections import LoggingSection
from rebm.distributed import Runtime
from rebm.distributed.collectives import RankFailed, WriteFailed, on_main
from rebm.distributed.logs import progress_enabled
from rebm.eval.files import write_text_replacing
from rebm.eval.results import jsonable

LOGGER = logging.getLogger("rebm")


def wandb_mode(logging: LoggingSection) -> str:
    """Precedence: the config's `wandb_disabled: true` / `wandb_mode: disabled` always win (an
    experiment that says no wandb gets none); otherwise the WANDB_MODE environment variable wins
    over `wandb_mode` (a job script decides for its machine); `auto` is online when an API key is
    configured (WANDB_API_KEY or ~/.netrc) and offline otherwise."""
    if logging.wandb_disabled or logging.wandb_mode == "disabled":
        return "disabled"
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if logging.wandb_mode != "auto":
        return logging.wandb_mode
    has_key = bool(os.environ.get("WANDB_API_KEY")) or os.path.exists(
        os.path.expanduser("~/.netrc")
    )
    return "online" if has_key else "offline"


def _record_step(line: bytes) -> float:
    """Step of a metrics.jsonl line. A line that is not a record (cut short by a crash, bytes
    that are not UTF-8, JSON that is not an object with a numeric step) counts as newer than
    any state, so the resumed run drops it."""
    try:
        record = json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError alike
        return math.inf
    step = record.get("step", 0) if isinstance(record, dict) else None
    numeric = isinstance(step, (int, float)) and not isinstance(step, bool)
    return step if numeric else math.inf


class Tracker:
    """Rank 0: writes config.yaml, metrics.jsonl, wandb, samples/. Other ranks: does nothing.
    `config` is the run's config as to_dict gives it (config.yaml and wandb hold it)."""

    def __init__(self, logging: LoggingSection, runtime: Runtime, run_directory: RunDirectory,
                 config: Dict[str, Any], last_step: float = math.inf):
        self.runtime = runtime
        self.last_step = last_step  # for the console summary's "step s/last"
        self.run_directory = run_directory
        self.wandb_run = None
        self.wandb_run_id: Optional[str] = None
        self.metrics_path = run_directory.metrics_file
        self.failed_write: Optional[str] = None  # rank 0: a training record it could not write
        self.logging = logging
        self.config = config

    def start_all_ranks(self, wandb_run_id: Optional[str] = None) -> "Tracker":
        """Rank 0 writes config.yaml and starts wandb (continuing `wandb_run_id`, a resumed
        run's); every rank calls this once, after the constructor (which runs no collective)."""
        self.wandb_run_id = wandb_run_id
        on_main(self.runtime, self._start, "write config.yaml or start wandb")
        return self

    def _start(self) -> None:
        # through a temp file: a write cut short (a full disk, a file-size limit) leaves the
        # previous config.yaml, never a part of one
        write_text_replacing(self.run_directory.config_file, yaml_of(self.config))
        mode = wandb_mode(self.logging)
        if mode != "disabled":
            self._init_wandb(mode)

    def _init_wandb(self, mode: str) -> None:
        try:
            import wandb
        except ImportError:
            LOGGER.warning("wandb is not installed; metrics go to metrics.jsonl only")
            return
        # The id is the run's identity in wandb: kept in every training state and in
        # <run_dir>/wandb_id (for a run that dies before its first state), so a resumed run
        # (any attempt, any world size) continues the same wandb run.
        id_file = self.run_directory.wandb_id_file
        if not self.wandb_run_id and os.path.exists(id_file):
            with open(id_file) as fh:
                self.wandb_run_id = fh.read().strip() or None
        self.wandb_run_id = self.wandb_run_id or uuid.uuid4().hex[:16]
        write_text_replacing(id_file, self.wandb_run_id + "\n")
        # wandb's own console lines (banner, run history and summary: ~25 lines a run) would
        # drown the run's; silent drops them (the run's files and wandb's logs/debug*.log stay
        # complete) and the line below says where the run is; WANDB_SILENT=false keeps them.
        quiet = None if "WANDB_SILENT" in os.environ else wandb.Settings(silent=True)
        self.wandb_run = wandb.init(
            project=self.logging.wandb_project,
            dir=self.logging.wandb_dir or self.run_directory.path,
            config=self.config, tags=list(self.logging.tags), mode=mode, id=self.wandb_run_id,
            resume="allow", name=os.path.basename(os.path.normpath(self.run_directory.path)),
            settings=quiet,
        )
        folder = os.path.dirname(self.wandb_run.dir)  # .../wandb/<offline-run-...>
        if not self.wandb_run.offline:
            LOGGER.info("wandb run %s: %s (files in %s)", self.wandb_run_id, self.wandb_run.url,
                        folder)
        else:
            LOGGER.info("wandb offline run %s; upload it with `wandb sync %s`",
                        self.wandb_run_id, folder)

    def truncate_metrics_after_all_ranks(self, step: int) -> None:
        """On resume, drop records newer than the restored state so the log matches a straight
        run (a preempted run may have logged steps after its last saved state)."""
        on_main(self.runtime, lambda: self._truncate(step), f"rewrite {self.metrics_path}")

    def _truncate(self, step: int) -> None:
        if not os.path.exists(self.metrics_path):
            return
        with open(self.metrics_path, "rb") as fh:  # bytes: a damaged line may not be UTF-8
            lines = [line for line in fh if line.strip()]
        kept = [line for line in lines if _record_step(line) <= step]
        if len(kept) != len(lines):
            tmp = self.metrics_path + ".tmp"
            with open(tmp, "wb") as fh:
                fh.writelines(kept)
            os.replace(tmp, self.metrics_path)

    def log_all_ranks(self, step: int, n_imgs: int, epoch: int, metrics: Dict[str, Any]) -> None:
        """One record in metrics.jsonl (and wandb)."""
        on_main(self.runtime, lambda: self._log(step, n_imgs, epoch, metrics),
                      f"write {self.metrics_path}")

    def log_training(self, step: int, n_imgs: int, epoch: int, metrics: Dict[str, Any]) -> None:
        """A training-metrics record, written by rank 0 without a collective (the metrics log
        costs one all-reduce, the window's): a failed write is kept, and the loop's next
        consensus stops every rank (`write_failed`, `raise_write_failure`). Without a progress
        bar (a log file, a pipe) also one console line with its numbers, so a batch job's log
        shows the run moving."""
        if not self.runtime.is_main:
            return
        try:
            self._log(step, n_imgs, epoch, metrics)
        except OSError as err:
            self.failed_write = (f"cannot write {self.metrics_path} ({err.strerror or err}); "
                                 "free disk space or fix the run directory's permissions")
        except Exception as err:  # e.g. wandb's; every rank raises it at the next consensus
            first = str(err).strip().splitlines()
            self.failed_write = (f"cannot record the training metrics of step {step} "
                                 f"({first[0] if first else type(err).__name__})")
        if not progress_enabled():
            LOGGER.info("%s", training_summary(step, self.last_step, epoch, metrics))

    @property
    def write_failed(self) -> bool:
        """Rank 0 could not write a training-metrics record (False on the other ranks)."""
        return self.failed_write is not None

    def raise_write_failure(self) -> None:
        """After a consensus saw `write_failed`: rank 0 raises its error, the others say whose
        it is (one line each, as `on_main`)."""
        if self.failed_write is not None:
            raise WriteFailed(self.failed_write)
        raise RankFailed(f"rank 0 could not write {self.metrics_path} (see its error)")

    def _log(self, step: int, n_imgs: int, epoch: int, metrics: Dict[str, Any]) -> None:
        record = {"step": step, "n_imgs": n_imgs, "epoch": epoch}
        record.update({k: jsonable(v) for k, v in metrics.items()})
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=step)

    def save_grid_all_ranks(self, images: torch.Tensor, name: str, step: int, nrow: int = 8
                            ) -> Optional[str]:
        """A PNG grid in samples/, also logged to wandb as an image."""
        path = self.run_directory.samples(name)
        on_main(self.runtime, lambda: self._save_grid(images, path, step, nrow), f"write {path}")
        return path

    def _save_grid(self, images: torch.Tensor, path: str, step: int, nrow: int) -> None:
        from torchvision.utils import save_image

        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_image(images.detach().float().cpu().clamp(0, 1), path, nrow=nrow)
        self._log_image(path, step)

    def log_image_all_ranks(self, path: str, step: int) -> None:
        """An image file (a sample grid) to wandb under its name's stem, e.g. `gen_samples`."""
        on_main(self.runtime, lambda: self._log_image(path, step), "log an image to wandb")

    def _log_image(self, path: str, step: int) -> None:
        if self.wandb_run is None or not os.path.exists(path):
            return
        import wandb

        key = "images/" + os.path.basename(path).split("_step")[0]
        self.wandb_run.log({key: wandb.Image(path)}, step=step)

    def log_table_all_ranks(self, name: str, step: int, values: Dict[str, Any]) -> None:
        """One evaluation's numbers to wandb as a table (metric, value), besides the scalars."""
        on_main(self.runtime, lambda: self._log_table(name, step, values), "log a table to wandb")

    def _log_table(self, name: str, step: int, values: Dict[str, Any]) -> None:
        if self.wandb_run is None:
            return
        import wandb

        rows = [[k, jsonable(v)] for k, v in values.items() if isinstance(v, (int, float))]
        self.wandb_run.log({name: wandb.Table(columns=["metric", "value"], data=rows)},
                           step=step)

    def close_all_ranks(self) -> None:
        on_main(self.runtime, self._close, "finish the wandb run")

    def _close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def training_summary(step: int, last_step: float, epoch: int, metrics: Dict[str, Any]) -> str:
    """One line of a training-metrics record, its names as in metrics.jsonl, e.g.
    'step 40/3900 (epoch 0): train_clf_loss 2.21 | learning_rate 0.1 | imgs_per_s 131 | ...'.
    Bookkeeping that says nothing (no unreadable images) is left out."""
    total = "" if math.isinf(last_step) else f"/{int(last_step)}"
    parts = []
    for key, value in metrics.items():
        value = jsonable(value)
        if (key, value) == ("data_replaced_images", 0):
            continue
        if isinstance(value, float):
            value = f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
        parts.append(f"{key} {value}")
    return f"step {step}{total} (epoch {epoch}): " + " | ".join(parts)


def duration(seconds: float) -> str:
    """'41s', '2m41s', '1h25m', '3d4h'."""
    seconds = max(int(round(seconds)), 0)
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


@dataclass
class ProgressLines:
    """Rank 0, without a progress bar (output to a log file or a pipe): a line every
    `interval_s` seconds, so that a batch job's log shows the run alive between metrics logs,
    e.g. 'progress: step 1234/3900, 52.1 img/s; next: metrics log at step 1300 in 2m41s,
    evaluation at step 1562 in 13m04s; end in 1h25m'. Images/s are over the time since the
    previous line (evaluations included), and so are the estimates."""

    interval_s: float
    last_step: float  # inf: the run has no end of its own
    global_batch_size: int
    current_step: Callable[[], int]  # the updates done
    events: Dict[str, Callable[[int], bool]]  # {event: due after update `step`}, in this order
    horizon: int  # how many steps ahead an event is looked for (its longest interval)
    mark: Optional[Tuple[float, int]] = None  # (time, step) of the previous line

    def after_step(self) -> None:
        now, step = time.monotonic(), self.current_step()
        if self.mark is None:  # the first step: the clock starts after any evaluation before it
            self.mark = (now, step)
        elif now - self.mark[0] >= self.interval_s:
            LOGGER.info("%s", self.line(step, (step - self.mark[1]) / (now - self.mark[0])))
            self.mark = (now, step)

    def line(self, step: int, steps_per_s: float) -> str:
        bounded = not math.isinf(self.last_step)
        parts = [f"progress: step {step}" + (f"/{int(self.last_step)}" if bounded else "")
                 + f", {steps_per_s * self.global_batch_size:.1f} img/s"]
        coming = [f"{name} at step {at}" + self.eta(at - step, steps_per_s)
                  for name, at in self.next_events(step).items()]
        if coming:
            parts.append("next: " + ", ".join(coming))
        if bounded:
            parts.append("end" + self.eta(int(self.last_step) - step, steps_per_s))
        return "; ".join(parts)

    @staticmethod
    def eta(steps: int, steps_per_s: float) -> str:
        return f" in {duration(steps / steps_per_s)}" if steps_per_s > 0 else ""

    def next_events(self, step: int) -> Dict[str, int]:
        """{event: the step after which it next runs}, for those within the horizon and the
        run."""
        found: Dict[str, int] = {}
        end = min(step + self.horizon, self.last_step)
        for name, due in self.events.items():
            at = step + 1
            while at <= end and not due(at):
                at += 1
            if at <= end:
                found[name] = at
        return found


def progress_lines(logging: LoggingSection, runtime: Runtime, **fields: Any
                   ) -> Optional[ProgressLines]:
    """ProgressLines on rank 0 when the console has no progress bar and
    `logging.progress_interval_s` is on; else None. `fields`: ProgressLines' others."""
    interval = logging.progress_interval_s
    if not runtime.is_main or progress_enabled() or not interval or interval <= 0:
        return None
    return ProgressLines(interval_s=interval, **fields)


class _ProgressBar:
    """tqdm on rank 0 (images/s, ETA, loss, lr, epoch, and the method's numbers, e.g. T and
    the adversarial AUC), or, without a bar, the timed progress lines (`lines`); nothing on
    other ranks."""

    def __init__(self, runtime: Runtime, start: int, total: float, batch_size: int,
                 lines: Optional[ProgressLines] = None):
        self.bar = None
        self.lines = lines
        if runtime.is_main:
            from tqdm import tqdm

            self.bar = tqdm(
                initial=start * batch_size, total=None if math.isinf(total) else total * batch_size,
                unit="img", unit_scale=True, dynamic_ncols=True, mininterval=2.0,
                disable=not progress_enabled(),
            )
        self.batch_size = batch_size

    def update(self, **postfix: Any) -> None:
        if self.bar is not None:
            self.bar.set_postfix({k: (f"{v:.3g}" if isinstance(v, float) else v)
                                  for k, v in postfix.items()}, refresh=False)
            self.bar.update(self.batch_size)
        if self.lines is not None:
            self.lines.after_step()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "_ProgressBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress_bar(runtime: Runtime, start: int, total: float, batch_size: int,
                 lines: Optional[ProgressLines] = None) -> _ProgressBar:
    return _ProgressBar(runtime, start, total, batch_size, lines)
