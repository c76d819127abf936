"""The CIFAR-10 recipe of the README with the *shipped* configs, end to end: stage 1 -> stage 2
(the paper's recipe, experiments/cifar10/cifar10-dat-WideResNet34x10-T40-seed0.yaml) -> evaluate,
each with torchrun on 2 CPU processes, wandb offline and FID on, on a fake CIFAR-10 in
torchvision's on-disk format and a fake seed-image file where the recipe reads it. Only sizes
change (steps, batch, a small WideResNet), plus the stand-in FID feature network (Inception
weights cannot be downloaded here).

The README evaluates the run's model_bestfid.pth, which only an Inception FID writes: the
stand-in's values are kept apart (`fid_standin`) and never pick a model, so this chain evaluates
model_final.pth, the model the same step writes in every run."""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path

import pytest

from rebm.standin.writers import (
    write_fake_cifar10,
    write_tensor_file,
    write_tiny_images,
    write_tinyimages_exclusion_lists,
)
from tests.helpers import BIN, REPO, base_env, finish, torchrun_cmd
from tests.processes import popen
from tests.wandb_files import offline_runs, read_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STAGE1 = str(REPO / "InNOutRobustnessMean0_cifar100" / "configs" / "cifar10_wrn34x10.yaml")
STAGE2 = str(REPO / "experiments" / "cifar10" / "cifar10-dat-WideResNet34x10-T40-seed0.yaml")
TRAIN_AT = str(REPO / "InNOutRobustnessMean0_cifar100" / "train_at.py")
SIZES = ["model.model_type=WideResNet10x1", "batch_size=32", "max_steps=3",
         "indist_attack_clf.max_steps=1", "data.num_workers=0", "robust_eval_steps=1",
         "n_imgs_per_evaluation_log=96", "n_imgs_per_metrics_log=32"]
STAGE2_SIZES = ["attack.max_steps=2", "min_imgs_per_threshold=64", "image_log.num_samples=20",
                "image_log.num_steps=2", "n_imgs_per_image_log=64", "n_imgs_per_ckpt_save=64"]
FID_STANDIN = {"REBM_FID_FEATURES": "rebm.eval.standin:features"}


def _run(cmd, cwd: Path, timeout: float = 300) -> str:
    env = base_env(1, {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                       "PYTHONPATH": str(REPO), **FID_STANDIN})
    code, out = finish(popen(cmd, env, cwd), timeout)
    assert code == 0, f"{cmd}\n{out[-6000:]}"
    return out


def test_cifar10_recipe_stage1_stage2_evaluate(tmp_path):
    """The user's directory holds data/ (as the configs expect) and gets runs/."""
    write_fake_cifar10(str(tmp_path / "data" / "CIFAR10"), n_train=96, n_test=40)
    write_tiny_images(str(tmp_path / "data" / "tiny_images.bin"), n_records=200)
    # the recipe's seed images of its samples (image_log.seed_images, the original's file name)
    write_tensor_file(str(tmp_path / "data" / "cifar_fid_imgs_50K.pt"), n=20, layout="NCHW")
    write_tinyimages_exclusion_lists(str(tmp_path / "data" / "TinyImagesExclusionIdcs"), 200)
    _run([sys.executable, "-m", "rebm.eval.fid_stats", STAGE2, "--out",
          "data/fid_stats/fid_stats_cifar10_train.npz"], tmp_path)
    _run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", TRAIN_AT, STAGE1, *SIZES,
          "wandb_disabled=false"], tmp_path)
    stage1 = tmp_path / "runs" / "stage1_cifar10"
    assert (stage1 / "model_final.pth").exists()
    assert (stage1 / "model_bestacc.pth").exists()  # In-N-Out's best_avg.pth, what stage 2 reads

    out = _run(torchrun_cmd("rebm.training.train", [STAGE2, *SIZES, *STAGE2_SIZES], 2), tmp_path)
    assert f"loaded checkpoint '{os.path.join('runs', 'stage1_cifar10', 'model_bestacc.pth')}'" \
        in out, out[-3000:]
    (stage2,) = glob.glob(str(tmp_path / "runs" / "cifar10" /
                                  "cifar10-dat-WideResNet34x10-T40-seed0*"))
    records = [json.loads(line) for line in open(os.path.join(stage2, "metrics.jsonl"))]
    evaluations = [r for r in records if "test_acc" in r]
    assert evaluations and all(r["fid_standin"] >= 0 for r in evaluations)  # a stand-in FID
    assert not os.path.exists(os.path.join(stage2, "model_bestfid.pth"))  # picked by FID only
    for run_dir in (stage1, Path(stage2)):  # wandb, offline, one run per stage
        (folder,) = offline_runs(run_dir)
        assert read_run(folder)["name"] == run_dir.name

    out = _run(torchrun_cmd("rebm.eval.evaluate", [
        STAGE2, *SIZES, *STAGE2_SIZES, f"model.ckpt_path={stage2}/model_final.pth",
        "--samples"], 2), tmp_path)
    metrics = json.loads(out.strip().splitlines()[-1])
    assert metrics["n_test"] == 40 and "fid_standin" in metrics and "robust_test_acc" in metrics
