"""When a DAT run evaluates, logs and saves previews: the original's loop, held here as data.

The original (github:xuwangyin/DAT at fb2ffc7) decides each interval event with
`should_trigger_event(step, batch_size, interval)` at the start of its step (1-indexed), and places
the events around the update as its loop in rebm/training/train.py does. Its rule and its loop are
written out below with their file:line; rebm.engine.events must give the same steps for every
event, and a real run must record them (metrics.jsonl, samples/, model_bestacc.pth)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rebm.config import load_config
from rebm.config.batch import BatchPlan
from rebm.config.sections import IntervalSection
from rebm.data.files import load_digits
from rebm.engine.events import EventSchedule
from rebm.models import model_from_config
from tests.helpers import CONFIG, read_metrics, run_train


def original_trigger(step: int, batch_size: int, interval_imgs: int) -> bool:
    """The original's start-of-step trigger (rebm/training/scheduling.py:70-87, at_end=False):
    the first step always; then a step whose images cross a multiple of the interval."""
    if step == 1:  # scheduling.py:73-74, "Special case for first step"
        return True
    before, after = (step - 1) * batch_size, step * batch_size  # scheduling.py:70-71, :85-86
    return before // interval_imgs < after // interval_imgs  # scheduling.py:87


# Where the original's loop runs each event of step k relative to k's update (optimizer.step(),
# train.py:625), as the number of updates done when it runs.
ORIGINAL_LOOP = {
    # triggered at train.py:503-510, run at :514-581, before zero_grad (:602): k - 1 updates
    "evaluation": lambda k: k - 1,
    # triggered at train.py:498-502, logged at :660-665 after the update: k updates
    "metrics": lambda k: k,
    # triggered at train.py:668-672, logged at :674-682 after the update: k updates
    "images": lambda k: k,
}


def original_events(event: str, batch_size: int, interval_imgs: int, steps: int) -> list:
    """The update counts at which the original's loop runs `event` over `steps` steps. Its loop
    ends before the step after the last (train.py:475-487), so nothing of step `steps` + 1
    runs."""
    return [ORIGINAL_LOOP[event](k) for k in range(1, steps + 1)
            if original_trigger(k, batch_size, interval_imgs)]


def rebm_events(event: str, batch_size: int, interval_imgs: int, steps: int) -> list:
    plan = BatchPlan(global_batch_size=batch_size, per_device_batch_size=batch_size,
                     accumulation_steps=1, world_size=1, eval_batch_size=batch_size)
    key = {"evaluation": "n_imgs_per_evaluation_log", "metrics": "n_imgs_per_metrics_log",
           "images": "n_imgs_per_image_log"}[event]
    events = EventSchedule(plan, IntervalSection(**{key: interval_imgs}), at_step_start=True,
                           last_step=steps)
    due = {"evaluation": events.evaluation_due, "metrics": events.log_due,
           "images": events.previews_due}[event]
    first = 0 if event == "evaluation" else 1
    return [s for s in range(first, steps + 1) if due(s)]


@pytest.mark.parametrize("batch_size", [128, 512])
@pytest.mark.parametrize("interval_imgs", [50_000, 1_280_000, 12_800, 100_000, 3_333, 512, 128])
@pytest.mark.parametrize("event", sorted(ORIGINAL_LOOP))
def test_every_event_at_the_original_steps(event, batch_size, interval_imgs):
    steps = max(3 * interval_imgs // batch_size + 5, 40)
    assert rebm_events(event, batch_size, interval_imgs, steps) == \
        original_events(event, batch_size, interval_imgs, steps)


def test_the_recipes_evaluations_include_the_starting_model():
    """The recipes' 50,000-image interval: evaluations after 0, 390, 781, 1171 updates at batch
    128, after 0, 97, 195, 292 at batch 512 (the updates before them, starting model first)."""
    assert rebm_events("evaluation", 128, 50_000, 1200) == [0, 390, 781, 1171]
    assert rebm_events("evaluation", 512, 50_000, 300) == [0, 97, 195, 292]


def _good_starting_model(cfg, path: Path) -> None:
    """A digits classifier trained with plain cross-entropy (a few seconds), so that the
    starting model's accuracy is well above what the first DAT updates at a high learning rate
    leave: the starting model must be the best candidate."""
    torch.manual_seed(0)
    model = model_from_config(cfg.model, cfg.data)
    train = load_digits(cfg.data.image_size, train=True)
    images, labels = train.data.float().div(255), train.targets
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(6):
        order = torch.randperm(len(labels))
        for start in range(0, len(labels), 64):
            idx = order[start:start + 64]
            loss = F.cross_entropy(model(images[idx]), labels[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    torch.save(model.state_dict(), path)


@pytest.mark.slow
@pytest.mark.numbers  # model_bestacc.pth against the starting weights, bit for bit
def test_a_run_evaluates_the_starting_model_before_each_crossing_update(tmp_path):
    """Two processes, batch 32, an evaluation every 80 images (not a multiple of the batch):
    the original evaluates at the start of steps 1, 3, 5, 8 (after 0, 2, 4, 7 updates), logs
    metrics after steps 1, 2, 4, 6, 8 and previews after 1, 3, 6; the starting model,
    the best here, is model_bestacc.pth; the final evaluation reports, it is no candidate."""
    start = tmp_path / "start.pth"
    cfg = load_config(CONFIG, [])
    _good_starting_model(cfg, start)
    run_dir = tmp_path / "run"
    steps, batch, every = 8, 32, 80
    run_train([CONFIG, f"model.ckpt_path={start}", f"batch_size={batch}", f"max_steps={steps}",
               "use_ema=false", "optimizer=sgd", "lr=0.02", "robust_eval=false",
               "attack.max_steps=2", "indist_attack_clf.max_steps=1", "min_imgs_per_threshold=64",
               f"n_imgs_per_evaluation_log={every}", "n_imgs_per_metrics_log=64",
               "n_imgs_per_image_log=96", "n_imgs_per_ckpt_save=32", "keep_last_states=100",
               "eval.num_images=120", "image_log.num_samples=10"],
              nproc=2, run_dir=run_dir, timeout=400).assert_ok()
    records = read_metrics(run_dir)
    evaluated = [r["step"] for r in records if "test_acc" in r]
    logged = [r["step"] for r in records if "train_clf_loss" in r]
    expected_evaluations = original_events("evaluation", batch, every, steps)
    assert expected_evaluations == [0, 2, 4, 7]
    assert evaluated == expected_evaluations + [steps]  # and rebm's report of the final model
    assert logged == original_events("metrics", batch, 64, steps)
    previews = sorted(int(p.stem.rsplit("step", 1)[1]) for p in (run_dir / "samples").glob(
        "train_adv_step*.png"))
    assert previews == original_events("images", batch, 96, steps) == [1, 3, 6]
    assert [r["n_imgs"] for r in records if "test_acc" in r][0] == 0
    # the starting model was the best candidate: model_bestacc.pth is its weights, bit for bit
    accuracy = {r["step"]: r["test_acc"] for r in records if "test_acc" in r}
    candidates = {s: accuracy[s] for s in expected_evaluations}
    assert candidates[0] > max(candidates[s] for s in expected_evaluations[1:]), \
        f"the high learning rate should leave every later model worse: {accuracy}"
    best = torch.load(run_dir / "model_bestacc.pth", weights_only=True)
    started = torch.load(start, weights_only=True)
    assert best.keys() == started.keys()
    assert all(torch.equal(best[k], started[k]) for k in best)
    state = torch.load(run_dir / "checkpoints" / f"state_{steps:09d}.pt", weights_only=False)
    assert state["progress"]["best"] == {"test_acc": candidates[0]}


@pytest.mark.slow
def test_a_resumed_run_does_not_evaluate_a_step_twice(tmp_path):
    """A run finished at step 4, whose final evaluation is the one the start of step 5 makes,
    continued to step 8: the continued run evaluates next at step 7, not at 4 again."""
    run_dir = tmp_path / "run"
    common = [CONFIG, "batch_size=32", "attack.max_steps=2", "indist_attack_clf.max_steps=1",
              "min_imgs_per_threshold=64", "n_imgs_per_evaluation_log=80",
              "n_imgs_per_metrics_log=64", "n_imgs_per_ckpt_save=32", "eval.num_images=60",
              "image_log.num_samples=10"]
    run_train([*common, "max_steps=4"], run_dir=run_dir, timeout=300).assert_ok()
    run_train([*common, "max_steps=8", "resume=force"], run_dir=run_dir,
              timeout=300).assert_ok()
    evaluated = [r["step"] for r in read_metrics(run_dir) if "test_acc" in r]
    # 0 and 2 (the start of steps 1 and 3); the first run's final evaluation at 4 is the one the
    # start of step 5 makes, so the continued run does not repeat it; then 7 (the start of
    # step 8) and the second run's final report at 8
    assert evaluated == [0, 2, 4, 7, 8]
    with open(run_dir / "metrics.jsonl") as fh:
        assert all(json.loads(line)["step"] >= 0 for line in fh)
