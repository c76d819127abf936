"""`python -m rebm.standin RECIPE [RECIPE ...] [--out DIR]`: the shipped recipes end to end on
stand-in data, before paying for GPU hours (docs/first_hour.md)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

from rebm.cli import user_errors_exit
from rebm.config import ConfigError

DEFAULT_OUT = "runs/standin"
MARK = ".rebm-standin"  # names a folder this command made (so that it adds to it, nothing else)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rebm.standin",
        description="Run shipped recipes (experiments/cifar10, cifar100, imagenet, and the "
                    "stage-1 configs) end to end on stand-in data written in the real on-disk "
                    "formats: the recipe's entry points, model family, attacks, curriculum, "
                    "evaluation, best-model rules, FID on stand-in features and wandb offline, "
                    "on 2 CPU processes under torchrun, shrunk only in size. Then: what was "
                    "exercised, and the files a real run still needs, with where each comes "
                    "from.")
    parser.add_argument("recipes", nargs="+", help="recipe YAML files (experiments/**/*.yaml)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"the stand-in folder: data/, checkpoints/, runs/, logs/ (default "
                             f"{DEFAULT_OUT}); recipes run into the same folder share its data "
                             "and stage-1 runs")
    parser.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds each command may run (default 1800)")
    return parser


def claim_folder(out: str) -> None:
    """Use `out` only when it is new, empty or made by this command: nothing else is touched."""
    if os.path.isdir(out) and os.listdir(out) and not os.path.exists(os.path.join(out, MARK)):
        raise ConfigError(f"--out '{out}' holds files this command did not write; name a new "
                          "or empty folder (--out DIR)")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out '{out}' is a file; name a folder (--out DIR)")
    os.makedirs(out, exist_ok=True)
    Path(out, MARK).touch()


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    with user_errors_exit():
        from rebm.standin.recipes import plan_recipe

        recipes = []
        for path in args.recipes:
            if not os.path.isfile(path):
                raise ConfigError(f"recipe '{path}' does not exist; name a YAML file of "
                                  "experiments/ (e.g. experiments/cifar10/*.yaml)")
            recipes.append(plan_recipe(Path(path)))
        if args.nproc < 1:
            raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
        claim_folder(args.out)
        from rebm.standin.session import run_recipe

        start = time.monotonic()
        for recipe in recipes:
            run_recipe(recipe, os.path.abspath(args.out), args.nproc, args.timeout)
        print(f"\n{len(recipes)} recipe(s) ran on stand-in data in "
              f"{time.monotonic() - start:.0f} s; everything is under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
