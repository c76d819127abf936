"""`python -m rebm.standin` without running a recipe: every shipped training recipe has a stand-in
plan that changes sizes only, the recipes tier stays out of `make test` and in CI, and bad input
is one line that leaves the folder as it was. The runs themselves: tests/test_standin_recipes.py."""

from __future__ import annotations

import re
import sys

import pytest

from rebm.standin.__main__ import MARK
from rebm.standin.recipes import (
    SIZES_CIFAR,
    SIZES_DAT,
    SIZES_IMAGENET,
    STAGE1_CONFIGS,
    plan_recipe,
    shipped_recipes,
)
from tests.helpers import REPO, base_env, run_separately

RECIPES = shipped_recipes()

SIZE_KEYS = {*SIZES_CIFAR, *SIZES_IMAGENET, *SIZES_DAT, "model.model_type",
             "indist_attack_clf.start_step"}


def test_every_shipped_training_recipe_is_in_the_tier():
    shipped = {p for p in (REPO / "experiments").rglob("*.yaml")
               if p.parent.name not in ("paper", "quickstart")} | set(STAGE1_CONFIGS.glob("*.yaml"))
    assert set(RECIPES) == shipped


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_the_stand_in_plan_changes_sizes_only(recipe):
    plan = plan_recipe(recipe)
    assert [s.number for s in plan.stages] == ([1] if recipe.parent == STAGE1_CONFIGS else
                                               [1, 2] if plan.family == "cifar" else [2])
    for stage in plan.stages:
        keys = {o.split("=", 1)[0] for o in stage.overrides} - {"run_dir"}
        assert keys <= SIZE_KEYS, keys - SIZE_KEYS
        small, large = (re.sub(r"\d+(x\d+)?|Tiny|_.*", "", cfg.model.model_type)
                        for cfg in (stage.cfg, plan.original))
        assert small in large  # the same family (WideResNet, ResNet...ImageNet, convnext)
    if plan.family == "cifar" and len(plan.stages) == 2:  # stage 2 reads stage 1's model
        stage1, stage2 = plan.stages
        assert plan.original.model.ckpt_path.startswith(stage1.run_dir)


def _makefile_recipe(target: str) -> str:
    text = (REPO / "Makefile").read_text()
    return re.search(rf"^{target}:.*\n((?:\t.*\n)+)", text, re.M).group(1)


def test_the_recipes_tier_runs_in_ci_not_in_make_test():
    assert '-m "not recipes"' in _makefile_recipe("test")
    assert '-m "not slow and not recipes"' in _makefile_recipe("test-fast")
    assert "-m recipes tests/test_standin_recipes.py" in _makefile_recipe("test-recipes")
    assert '-m "not slow or bridge"' in _makefile_recipe("test-oldest")  # recipes are slow too
    assert re.search(r"^make test-recipes\b", (REPO / ".ci" / "run").read_text(), re.M)


@pytest.mark.slow
def test_bad_input_is_one_line_and_nothing_is_touched(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    recipe = str(REPO / "experiments" / "cifar10" / "cifar10-dat-WideResNet34x10-T50.yaml")
    cases = {
        "is a paper table": [str(REPO / "experiments" / "paper" / "cifar10.yaml")],
        "make quickstart runs it": [str(REPO / "experiments" / "quickstart" / "digits.yaml")],
        "does not exist": [str(tmp_path / "nope.yaml")],
        "holds files this command did not write": [recipe, "--out", str(foreign)],
    }
    env = base_env(1, {"PYTHONPATH": str(REPO)})
    for expected, args in cases.items():
        result = run_separately([sys.executable, "-m", "rebm.standin", *args], env, 120)
        assert result.returncode == 2, result.stderr[-3000:]
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], result.stderr[-3000:]
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"] and not (foreign / MARK).exists()
