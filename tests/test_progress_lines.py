"""A run whose output is not a terminal prints a progress line every `progress_interval_s`
seconds (rank 0 only): the steps done of those planned, images/s, and when the next metrics log,
state save and the end come; with the interval off it prints none, and with a progress bar the
bar stays. Time-based: the tests assert what the lines say, not how many there are."""

from __future__ import annotations

import re

import pytest

from rebm.config import load_config
from rebm.distributed import Runtime
from rebm.engine.tracking import duration, progress_lines
from tests.helpers import CONFIG, REPO, base_env, finish, torchrun_cmd
from tests.processes import popen

STEPS = 60
# 32 images a step: a metrics log every 10 steps, a state every 20 (none at the last step: the
# run saves its final state then anyway)
RUN = [CONFIG, "batch_size=32", "attack.max_steps=1", "attack.start_step=1",
       "indist_attack_clf.max_steps=1", "n_imgs_per_evaluation_log=null",
       "n_imgs_per_metrics_log=320", "n_imgs_per_ckpt_save=640", "n_imgs_per_image_log=100000",
       f"max_steps={STEPS}"]
LINE = re.compile(r"\[rank (\d)/2\] INFO progress: step (\d+)/(\d+), ([\d.]+) img/s(.*)$")


def _run_piped(tmp_path, *overrides: str) -> str:
    """A 2-process run with its output to a pipe (as under SLURM or nohup: no progress bar)."""
    env = base_env(1, {"REBM_PROGRESS": "", "PYTHONPATH": str(REPO)})
    code, out = finish(popen(torchrun_cmd("rebm.training.train",
                                          [*RUN, *overrides, f"run_dir={tmp_path / 'run'}"], 2),
                             env, REPO), 300)
    assert code == 0, out[-4000:]
    return out


def _events(rest: str) -> dict:
    """{event: step} of a line's 'next: metrics log at step 30 in 2s, ...'."""
    return {name: int(step) for name, step in re.findall(r"(metrics log|state save|evaluation) "
                                                         r"at step (\d+)", rest)}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_piped_run_prints_timed_progress_lines_with_the_right_steps(tmp_path):
    out = _run_piped(tmp_path, "progress_interval_s=0.25")
    lines = [LINE.search(line) for line in out.splitlines() if "INFO progress: " in line]
    assert lines and all(lines), out[-4000:]
    assert {m.group(1) for m in lines} == {"0"}  # rank 0 only
    steps = [int(m.group(2)) for m in lines]
    assert steps == sorted(steps) and 1 <= steps[0] and steps[-1] <= STEPS, steps
    for m in lines:
        step, rest = int(m.group(2)), m.group(5)
        assert int(m.group(3)) == STEPS and float(m.group(4)) > 0, m.group(0)
        events = _events(rest)
        # the next of each within the run, as its interval puts it
        next_log, next_save = (step // 10 + 1) * 10, (step // 20 + 1) * 20
        assert events.get("metrics log") == (next_log if next_log <= STEPS else None), rest
        assert events.get("state save") == (next_save if next_save < STEPS else None), rest
        assert "evaluation" not in events, rest  # the run has none
        assert re.search(r"; end in \d+[smhd]", rest), rest


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_interval_off_prints_none(tmp_path):
    out = _run_piped(tmp_path, "progress_interval_s=null")
    assert "finished at step 60" in out, out[-3000:]
    assert "progress:" not in out, out[-3000:]


def test_a_progress_bar_keeps_the_console_to_itself(monkeypatch):
    """With a bar (a terminal, or REBM_PROGRESS=1) there are no timed lines; without one, rank 0
    alone gets them."""
    cfg = load_config(CONFIG, ["progress_interval_s=5"])
    assert cfg.logging.progress_interval_s == 5
    fields = dict(last_step=10, global_batch_size=32, current_step=lambda: 0, events={},
                  horizon=1)
    monkeypatch.setenv("REBM_PROGRESS", "1")
    assert progress_lines(cfg.logging, Runtime(), **fields) is None
    monkeypatch.setenv("REBM_PROGRESS", "0")
    assert progress_lines(cfg.logging, Runtime(), **fields).interval_s == 5
    assert progress_lines(cfg.logging, Runtime(rank=1, world_size=2), **fields) is None
    off = load_config(CONFIG, ["progress_interval_s=0"])
    assert progress_lines(off.logging, Runtime(), **fields) is None


def test_durations_read_at_a_glance():
    assert [duration(s) for s in (0.4, 41, 161, 3 * 3600 + 25 * 60 + 7, 2 * 86400 + 4 * 3600)] \
        == ["0s", "41s", "2m41s", "3h25m", "2d4h"]


def test_a_run_without_an_end_says_when_its_events_come(monkeypatch):
    """No `/last` and no end for a run without max_steps or total_epochs; the events are those
    of the run's own schedule (the original DAT loop's: an evaluation after update 19 runs at
    the start of step 20, the one that crosses 640 images)."""
    from rebm.config import plan_batches
    from rebm.engine.events import EventSchedule

    cfg = load_config(CONFIG, ["batch_size=32", "n_imgs_per_metrics_log=320",
                               "n_imgs_per_evaluation_log=640", "max_steps=null",
                               "total_epochs=null"])
    monkeypatch.setenv("REBM_PROGRESS", "0")  # no bar, as in a job's log
    plan = plan_batches(cfg.schedule, cfg.eval, 1)
    events = EventSchedule(plan, cfg.intervals, at_step_start=True, last_step=float("inf"))
    lines = progress_lines(cfg.logging, Runtime(), last_step=float("inf"),
                           global_batch_size=32, current_step=lambda: 5, horizon=30,
                           events={"metrics log": events.log_due,
                                   "evaluation": events.evaluation_due})
    line = lines.line(5, steps_per_s=2.0)
    assert line == ("progress: step 5, 64.0 img/s; next: metrics log at step 10 in 2s, "
                    "evaluation at step 19 in 7s"), line
