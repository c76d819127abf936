"""A run names every file it lacks at once, before anything starts: the paper's CIFAR-10 recipe,
run from a folder holding its whole data/ tree in stand-in form (rebm.standin.writers),
with three files deleted, stops with one report naming the three, each with where it comes
from, and writes nothing; `--check` names the same kind of files as warnings, inside folders
that exist."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from rebm.standin.writers import (
    write_fake_cifar10,
    write_tensor_file,
    write_tiny_images,
    write_tinyimages_exclusion_lists,
)
from tests.helpers import REPO, base_env, error_lines, finish, rebm_traceback_lines, torchrun_cmd
from tests.processes import popen
from tests.standins import STANDIN, write_standin_statistics

RECIPE = str(REPO / "experiments" / "cifar10" / "cifar10-dat-WideResNet34x10-T40-seed0.yaml")
RUN_DIR = "runs/missing"


def write_recipe_inputs(root: Path) -> None:
    """Every file the recipe reads, at the paths it names (relative to `root`): CIFAR-10, 80M
    TinyImages and the original's exclusion lists, FID statistics of the stand-in features,
    seed images, and a placeholder of the stage-1 weights (the check looks for the file; the
    tests never get as far as reading it)."""
    data = root / "data"
    write_fake_cifar10(str(data / "CIFAR10"), n_train=300, n_test=51)
    write_tiny_images(str(data / "tiny_images.bin"), 500)
    write_tinyimages_exclusion_lists(str(data / "TinyImagesExclusionIdcs"), 500)
    (data / "fid_stats").mkdir()
    write_standin_statistics(data / "fid_stats" / "fid_stats_cifar10_train.npz",
                             np.zeros(15), np.eye(15))
    write_tensor_file(str(data / "cifar_fid_imgs_50K.pt"), n=40)
    weights = root / "runs" / "stage1_cifar10" / "model_bestacc.pth"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"placeholder")


def _env() -> dict:
    return base_env(1, {"PYTHONPATH": str(REPO), "REBM_PROGRESS": "0",
                        "REBM_FID_FEATURES": STANDIN})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_names_every_missing_file_at_once_and_writes_nothing(tmp_path):
    write_recipe_inputs(tmp_path)
    deleted = ["data/CIFAR10/cifar-10-batches-py/data_batch_3", "data/tiny_images.bin",
               "data/cifar_fid_imgs_50K.pt"]
    for path in deleted:
        (tmp_path / path).unlink()
    started = time.monotonic()
    code, out = finish(popen(torchrun_cmd("rebm.training.train",
                                          [RECIPE, "data.num_workers=0", f"run_dir={RUN_DIR}"], 2),
                             _env(), tmp_path), 240)
    elapsed = time.monotonic() - started
    assert code != 0, out[-3000:]
    errors = [line for line in error_lines(out) if "error: " in line]
    assert errors == ["[rank 0] error: the run lacks 3 files it reads (nothing was started or "
                      "written; add them and run the same command again):"], out[-3000:]
    report = out[out.index(errors[0]):].splitlines()[1:4]
    sources = {"data_batch_3": "set data.download=true to download it, or extract "
                               "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
               "tiny_images.bin": "download http://www.archive.org/download/",
               "cifar_fid_imgs_50K.pt": "image_log.seed_images=lowfreq-noise"}
    for line, path in zip(report, deleted, strict=True):
        assert line.startswith("  - ") and f"./{path} does not exist; " in line, report
        assert sources[Path(path).name] in line, line
    assert not rebm_traceback_lines(out), out[-3000:]
    assert not re.search(r"INFO DAT \| run dir", out), out[-3000:]  # no trainer started
    assert not (tmp_path / RUN_DIR).exists()  # not even the run directory
    print(f"the report came {elapsed:.1f}s after torchrun started")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_check_looks_inside_existing_folders(tmp_path):
    """An exclusion list, the FID statistics and the stage-1 weights: --check warns about each
    (in folders that exist), with where it comes from, and passes."""
    write_recipe_inputs(tmp_path)
    for path in ("data/TinyImagesExclusionIdcs/80mn_cifar101_idxs.txt",
                 "data/fid_stats/fid_stats_cifar10_train.npz",
                 "runs/stage1_cifar10/model_bestacc.pth"):
        (tmp_path / path).unlink()
    code, out = finish(popen([sys.executable, "-m", "rebm.training.train", RECIPE, "--check"],
                             _env(), tmp_path), 150)
    assert code == 0, out[-3000:]
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert any("data.tinyimages_exclusion_dir: ./data/TinyImagesExclusionIdcs/"
               "80mn_cifar101_idxs.txt does not exist; copy InNOutRobustness/"
               "TinyImagesExclusionIdcs/ of the original" in line for line in warnings), warnings
    assert any("./data/fid_stats/fid_stats_cifar10_train.npz" in line
               and "python -m rebm.eval.fid_stats" in line for line in warnings), warnings
    assert any("model.ckpt_path 'runs/stage1_cifar10/model_bestacc.pth' does not exist" in line
               for line in warnings), warnings
    assert len(warnings) == 3, warnings  # nothing else of the tree is reported


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_stage_1_checks_what_it_reads_and_only_that(tmp_path):
    """Stage 1 trains on the in-distribution alone: a missing CIFAR file stops it at once with
    its one line, and an out-distribution it does not read (tinyimages without its file) is not
    asked for."""
    write_recipe_inputs(tmp_path)
    for path in ("data/CIFAR10/cifar-10-batches-py/test_batch", "data/tiny_images.bin"):
        (tmp_path / path).unlink()
    config = REPO / "InNOutRobustnessMean0_cifar100" / "configs" / "cifar10_wrn34x10.yaml"
    code, out = finish(popen([sys.executable, str(config.parents[1] / "train_at.py"),
                              str(config), "data.outdist_dataset=tinyimages",
                              "data.outdist_std_dir=./data", f"run_dir={RUN_DIR}"],
                             _env(), tmp_path), 150)
    errors = [line for line in error_lines(out) if "error: " in line]
    assert code == 2 and errors == [
        "error: data.indist_ds_dir: ./data/CIFAR10/cifar-10-batches-py/test_batch does not "
        "exist; set data.download=true to download it, or extract "
        "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz into ./data/CIFAR10"], out
    assert not (tmp_path / RUN_DIR).exists()
