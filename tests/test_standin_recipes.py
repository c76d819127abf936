"""The recipes tier (`make test-recipes`; CI runs it, `make test` does not): every shipped training
recipe (experiments/cifar10, cifar100, imagenet, and the stage-1 configs) run end to end by
`python -m rebm.standin` on stand-in data, one command per dataset into one folder, so that the
CIFAR stage-2 recipes share their data and their stage-1 run as in a real project folder. Each
test reads what the runs wrote: evaluation records, model files, samples, wandb's offline run,
the curriculum's T against its rule, and the report's list of the files a real run needs."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from rebm.config import load_config
from rebm.standin.recipes import STAGE1_CONFIGS, plan_recipe, shipped_recipes
from tests.helpers import REPO, base_env, finish
from tests.processes import popen

pytestmark = [pytest.mark.slow, pytest.mark.recipes, pytest.mark.timeout(1800)]

RECIPES = shipped_recipes()
GROUP_TIMEOUT_S = 1500


def group_of(path: Path) -> str:
    """The dataset a recipe reads: the recipes of one dataset share a stand-in folder."""
    return load_config(str(path), []).data.indist_dataset.replace("-conditional", "")


GROUPS: Dict[str, List[Path]] = {}
for _path in RECIPES:  # stage-1 configs first: the stage-2 recipes then reuse their runs
    GROUPS.setdefault(group_of(_path), []).append(_path)
for _paths in GROUPS.values():
    _paths.sort(key=lambda p: p.parent != STAGE1_CONFIGS)


@pytest.fixture(scope="module")
def group_runs(tmp_path_factory):
    """group -> (stand-in folder, the command's output), each group run once, when first asked."""
    done: Dict[str, tuple] = {}

    def run(group: str):
        if group not in done:
            folder = tmp_path_factory.mktemp(f"standin-{group}")
            cmd = [sys.executable, "-m", "rebm.standin", *map(str, GROUPS[group]),
                   "--out", str(folder / "project")]
            code, out = finish(popen(cmd, base_env(1, {"PYTHONPATH": str(REPO)}), folder),
                               GROUP_TIMEOUT_S)
            assert code == 0, out[-6000:]
            done[group] = (folder / "project", out)
        return done[group]
    return run


def records(run_dir: Path):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return [r for r in rows if "test_acc" not in r], [r for r in rows if "test_acc" in r]


def check_curriculum(stage, train) -> None:
    """T at each step follows DAT's rule from the AUCs the run logged: with a window of one step,
    T rises by one after a step whose AUC reaches AUC_th, up to the cap."""
    method = stage.cfg.method
    assert math.ceil(method.min_imgs_per_threshold / stage.cfg.schedule.batch_size) == 1
    assert train[0]["cur_outdist_steps"] == method.attack.start_step
    for before, after in zip(train[:-1], train[1:], strict=True):
        risen = before["cur_outdist_steps"] + (before["train_adv_auc"] >= method.AUC_th)
        assert after["cur_outdist_steps"] == min(risen, method.attack.max_steps), (before, after)


def check_stage(stage, folder: Path) -> None:
    run_dir = folder / stage.run_dir
    train, evaluations = records(run_dir)
    cfg = stage.cfg
    assert [r["step"] for r in train] == list(range(1, cfg.schedule.max_steps + 1))
    assert evaluations[-1]["step"] == cfg.schedule.max_steps  # the final evaluation
    assert all("robust_test_acc" in r and r["n_test"] > 0 for r in evaluations)
    assert (run_dir / "model_final.pth").exists() and (run_dir / "model_bestacc.pth").exists()
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb ran offline"
    if stage.number == 1:
        return
    check_curriculum(stage, train)
    assert all(r["fid_standin"] >= 0 for r in evaluations)  # FID on the stand-in features
    if cfg.image_log.adaptive_steps:
        assert all("fid_standin_best_steps" in r for r in evaluations)
    assert not (run_dir / "model_bestfid.pth").exists()  # picked by the Inception FID only
    assert list((run_dir / "samples").iterdir())


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_the_recipe_runs_end_to_end_on_stand_in_data(recipe, group_runs):
    folder, output = group_runs(group_of(recipe))
    plan = plan_recipe(recipe)
    report = output.split(f"== {recipe} on stand-in data", 1)[1].split("\n== ", 1)[0]
    for stage in plan.stages:
        check_stage(stage, folder)
        assert f"size overrides: {' '.join(stage.overrides)}\n" in output  # printed, each
    assert f"curriculum T {plan.stages[-1].cfg.method.attack.start_step} ->" in report or \
        plan.stages[-1].number == 1
    needs = report.split("files a real run of this recipe needs", 1)[1]
    keys = ["data.indist_ds_dir"] + (["data.outdist_std_dir", "image_log.data_dir",
                                      "image_log.seed_images", "model.ckpt_path"]
                                     if plan.stages[-1].number == 2 else [])
    for key in keys:
        assert f"({key})\n" in needs and "           from " in needs, (key, needs)


def test_the_cifar_stage_2_recipes_share_their_stage_1_run(group_runs):
    folder, output = group_runs("cifar10")
    stage2 = [p for p in GROUPS["cifar10"] if p.parent != STAGE1_CONFIGS]
    assert output.count("reusing runs/stage1_cifar10") == len(stage2)
    assert [p.name for p in (folder / "runs").glob("stage1_*")] == ["stage1_cifar10"]


def test_imagenet_recipes_start_from_the_public_checkpoint_layouts(group_runs):
    folder, _ = group_runs("ImageNet")
    for recipe in GROUPS["ImageNet"]:
        log = (folder / "logs" / f"stage2-{recipe.stem}.log").read_text()
        layout = "module." if "convnext" in recipe.stem.lower() else "robustness (model.*)"
        assert "loaded checkpoint" in log and layout in log, log[-3000:]
    advanced = [r for r in GROUPS["ImageNet"]
                if max(t["cur_outdist_steps"] for t in records(
                    folder / plan_recipe(r).stages[-1].run_dir)[0]) > 0]
    assert advanced, "no ImageNet recipe's curriculum raised T"
