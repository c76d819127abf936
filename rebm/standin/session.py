"""One recipe on stand-in data: its data written, its stages run (a finished stage-1 run of the
same folder is reused), then what was exercised and what a real run still needs."""

from __future__ import annotations

import os
import time

from rebm.standin.data import write_stage_data
from rebm.standin.recipes import Recipe, Stage
from rebm.standin.report import exercised_lines, needed_files_lines
from rebm.standin.run import fid_statistics_command, run_logged, stage_command

ENTRY = {1: "InNOutRobustnessMean0_cifar100/train_at.py", 2: "-m rebm.training.train"}


def display(path) -> str:
    """A path as the user typed it would be: relative to the current folder when inside it."""
    text = os.path.relpath(path)
    return str(path) if text.startswith("..") else text


def prepare_stage(stage: Stage, recipe: Recipe, folder: str, timeout_s: float) -> None:
    """Write the stage's stand-in files, and the FID statistics by the real command."""
    here = os.getcwd()
    os.chdir(folder)  # the recipe's paths are relative to the folder it runs in
    try:
        written = write_stage_data(stage, recipe.family)
        stats = stage.cfg.image_log.data_dir
        need_stats = stage.number == 2 and stage.cfg.image_log.log_fid and not os.path.exists(stats)
    finally:
        os.chdir(here)
    if written:
        print(f"  stand-in files written: {', '.join(written)}")
    if need_stats:
        seconds = run_logged(fid_statistics_command(stage), folder, f"fid_stats-{recipe.name}",
                             timeout_s)
        print(f"  stand-in FID statistics: {stats} (python -m rebm.eval.fid_stats, "
              f"{seconds:.0f} s)")


def run_stage(stage: Stage, recipe: Recipe, folder: str, nproc: int, timeout_s: float) -> None:
    print(f"stage {stage.number}: {display(stage.config)} through {ENTRY[stage.number]} "
          f"on {nproc} processes, run_dir {stage.run_dir}")
    print(f"  size overrides: {' '.join(stage.overrides)}")
    prepare_stage(stage, recipe, folder, timeout_s)
    final = os.path.join(folder, stage.run_dir, "model_final.pth")
    if os.path.exists(final):
        print(f"  finished in this folder before: reusing {stage.run_dir}")
        return
    seconds = run_logged(stage_command(stage, nproc), folder,
                         f"stage{stage.number}-{recipe.name}", timeout_s)
    print(f"  ran in {seconds:.0f} s (log: logs/stage{stage.number}-{recipe.name}.log)")


def run_recipe(recipe: Recipe, folder: str, nproc: int, timeout_s: float) -> None:
    print(f"\n== {display(recipe.path)} on stand-in data in {display(folder)}")
    start = time.monotonic()
    for stage in recipe.stages:
        run_stage(stage, recipe, folder, nproc, timeout_s)
    print(f"exercised ({time.monotonic() - start:.0f} s):")
    for line in exercised_lines(recipe, folder):
        print(f"  {line}")
    print("files a real run of this recipe needs (relative to the current folder):")
    for line in needed_files_lines(recipe):
        print(f"  {line}")
