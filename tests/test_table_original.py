"""An original model config (the original code's model_configs/*.yaml) runs as it is: a file is a
one-row table, a folder one table per dataset, with the protocol of the shipped paper table of
its dataset. The files below are copies of the original's (xuwangyin/DAT at fb2ffc7), their
values unchanged; the end-to-end runs use a tiny protocol table (`--protocol`) and a tiny
CIFAR-10 written here."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from rebm.eval.table.spec import TableError, load_table
from rebm.standin.writers import write_fake_cifar10
from tests.helpers import REPO, base_env, run_command
from tests.standins import write_standin_statistics

STANDIN = "rebm.eval.standin:features"
CIFAR10_T40_SEED0 = """\
method: "dat"
dataset: cifar10
checkpoint: wandb/robust-ebms-2/wandb/run-20250506_140002-4oni26z2/files/model_bestfid.pth
model_type: WideResNet34x10
train_cmd: >
  python -m rebm.training.train
  experiments/cifar10/cifar10_conditional_r1reg0_augauto_innoutloader_steps40_bs128_indistxent_sgd_lr0.001_stesp50_wd_wrn3410_indistaugoriginal_innoutpretrained_mean0_bestavg_ema_logsumexp_seed1.yaml
  rand_seed=0
  image_log.log_fid=true
fid_eval_config: experiments/cifar10/eval_fid/cifar10_conditional_wrn3410_eval_fid_steps33.yaml
fid_num_steps: 33
pgd_epsilon: 0.5
notes: |
  Dual-AT (T=40), AUC_th=0.8
"""
CIFAR10_T40_SEED1 = CIFAR10_T40_SEED0.replace("run-20250506_140002-4oni26z2",
                                              "run-20250502_142218-q4ccywk7").replace(
    "rand_seed=0", "rand_seed=1").replace("fid_num_steps: 33", "fid_num_steps: 32")
IMAGENET_RESNET50_224 = """\
method: "dat"
dataset: imagenet
checkpoint: wandb/robust-ebms-2/wandb/run-20250918_123627-hn3klw0q/files/model_bestfid.pth
model_type: ResNet50ImageNet
train_cmd: >
  python -m rebm.training.train
  experiments/imagenet/imagenet_indistonly_joint_resnet50_bs512_imagenetnormalization_newopenimages_stepsize2.0_ema_imglogsteps15_sweepsamples2560_300K.yaml
  rand_seed=1
  AUC_th=0.7
fid_eval_config: experiments/imagenet/imagenet_indistonly_joint_resnet50timm_fid_50Ksamples_newopenimages.yaml
fid_num_steps: 13
pgd_epsilon: 3.0
image_size: 224
notes: ""
"""
IMAGENET_WRN50X4_256 = """\
method: "dat"
dataset: imagenet
checkpoint: wandb/robust-ebms-2/wandb/run-20251031_233857-kxcejmlq/files/model_bestfid.pth
model_type: WideResNet50x4ImageNet
fid_eval_config: experiments/imagenet/imagenet_indistonly_joint_resnet50timm_fid_50Ksamples_newopenimages.yaml
fid_num_steps: 17
pgd_epsilon: 3.0
image_size: 256
notes: "Dual-AT WideResNet50x4, 256x256, T=30."
"""
IMAGENET_AT_CONVNEXT_256 = """\
method: "at"
dataset: imagenet
checkpoint: checkpoints/convnext_large_cvst_robust.pt
model_type: convnext_large
fid_eval_config: experiments/imagenet/imagenet_indistonly_joint_convnext_fid_50Ksamples_newopenimages.yaml
fid_num_steps: 0
pgd_epsilon: 3.0
image_size: 256
notes: "Standard AT ConvNeXt-Large with ConvStem at 256x256 (no input normalization)."
"""
IMAGENET_DAT_CONVNEXT_BASE = """\
method: "dat"
dataset: imagenet
checkpoint: checkpoints/convnext_b_cvst_robust.pt
model_type: convnext_base
fid_eval_config: experiments/imagenet/imagenet_indistonly_joint_resnet50timm_fid_50Ksamples_newopenimages.yaml
fid_num_steps: 15
pgd_epsilon: 3.0
image_size: 224
"""
ORIGINALS = {
    "cifar10-dat-WideResNet34x10-T40-seed0.yaml": CIFAR10_T40_SEED0,
    "imagenet-dat-ResNet50ImageNet-T15-300K-seed1.yaml": IMAGENET_RESNET50_224,
    "imagenet-dat-WideResNet50x4ImageNet-T30-256x256.yaml": IMAGENET_WRN50X4_256,
    "imagenet-at-ConvNeXtLarge-convst-256x256.yaml": IMAGENET_AT_CONVNEXT_256,
}
SAMPLE_METRICS = ("fid", "inception_score", "precision_recall")


def _write(folder: Path, files: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def test_original_configs_become_rows_with_the_originals_evaluation_settings(tmp_path):
    from rebm.eval.commands.table import load_tables
    from rebm.eval.table.spec import row_sections

    folder = _write(tmp_path / "model_configs", ORIGINALS)
    cifar, imagenet = load_tables(str(folder))
    assert (cifar.stem, imagenet.stem) == ("model_configs-cifar10", "model_configs-imagenet")
    assert [r.name for r in imagenet.rows] == sorted(Path(n).stem for n in ORIGINALS
                                                     if n.startswith("imagenet"))
    for table, paper in ((cifar, "cifar10"), (imagenet, "imagenet256")):
        protocol = load_table(str(REPO / "experiments" / "paper" / f"{paper}.yaml"))
        assert (table.metrics, table.batch_size, table.overrides, table.columns) == (
            protocol.metrics, protocol.batch_size, protocol.overrides, protocol.columns)
    ckpts = "/project"
    configs = {**row_sections(cifar, ckpts), **row_sections(imagenet, ckpts)}
    rows = {r.name: r for r in (*cifar.rows, *imagenet.rows)}

    row = rows["cifar10-dat-WideResNet34x10-T40-seed0"]
    assert (row.group, row.seed, row.baseline) == ("cifar10-dat-WideResNet34x10-T40", 0, False)
    assert row.notes == "Dual-AT (T=40), AUC_th=0.8"
    cfg = configs[row.name]["fid"]
    assert cfg.model.ckpt_path == f"{ckpts}/{row.checkpoint}" and cfg.ema.use_ema is False
    assert (cfg.model.model_type, cfg.data.indist_dataset, cfg.data.image_size) == (
        "WideResNet34x10", "cifar10-conditional", 32)
    assert (cfg.image_log.num_steps, cfg.method.indist_attack_clf.eps) == (33, 0.5)
    assert configs[row.name]["counterfactuals"].eval.counterfactual_steps == 33

    # 224 px: accuracy and AutoAttack at 224 (run_acc_eval.py --img_size), samples at 256 (the
    # FID template's data.image_size)
    row = rows["imagenet-dat-ResNet50ImageNet-T15-300K-seed1"]
    assert (row.group, row.seed, row.baseline) == ("imagenet-dat-ResNet50ImageNet-T15-300K", 1,
                                                   False)
    for metric, cfg in configs[row.name].items():
        assert cfg.data.image_size == (256 if metric in SAMPLE_METRICS else 224), metric
        assert (cfg.model.model_type, cfg.model.normalize_input) == ("ResNet50ImageNet", True)
        assert (cfg.image_log.num_steps, cfg.method.indist_attack_clf.eps) == (13, 3.0)
        assert cfg.method.indist_attack_clf.norm == "L2" and cfg.ema.use_ema is False
    assert configs[row.name]["autoattack"].eval.image_ids == "robustbench"

    row = rows["imagenet-dat-WideResNet50x4ImageNet-T30-256x256"]
    for cfg in configs[row.name].values():
        assert (cfg.data.image_size, cfg.model.model_type, cfg.image_log.num_steps) == (
            256, "WideResNet50x4ImageNet", 17)

    # ConvNeXt: ConvStem, no input normalisation (evaluate_imagenet_robustbench.py, the ConvNeXt
    # FID template), a baseline (method at)
    row = rows["imagenet-at-ConvNeXtLarge-convst-256x256"]
    assert row.baseline and row.checkpoint == "checkpoints/convnext_large_cvst_robust.pt"
    for cfg in configs[row.name].values():
        assert (cfg.model.model_type, cfg.model.use_convstem, cfg.model.normalize_input) == (
            "convnext_large", True, False)
        assert (cfg.data.image_size, cfg.image_log.num_steps) == (256, 0)
    assert not cifar.notices and not imagenet.notices


def test_keys_rebm_does_not_honour_are_one_notice_line_each(tmp_path):
    from rebm.eval.table.original_configs import original_tables

    path = tmp_path / "imagenet-dat-ConvNeXtBase-convst.yaml"
    path.write_text(IMAGENET_DAT_CONVNEXT_BASE + "threat_modle: L2\n")
    (notices,) = [t.notices for t in original_tables(str(path))]
    assert len(notices) == 3 and all("\n" not in n and n.startswith(f"{path}: ") for n in notices)
    assert "fid_eval_config names a template with normalize_input: true" in notices[1]
    assert "model_type convnext_base: the original's run_acc_eval.py" in notices[2]
    assert "key 'threat_modle' is not a key of the original's model configs" in notices[0]

    no_size = tmp_path / "imagenet-at-ResNet50ImageNet.yaml"
    no_size.write_text(IMAGENET_RESNET50_224.replace("image_size: 224\n", ""))
    (table,) = original_tables(str(no_size))
    assert table.notices == (f"{no_size}: image_size is not set (the original's eval_utils.py "
                             "refuses an ImageNet config without it); the protocol table's size "
                             "is used",)


@pytest.mark.parametrize("change, message", [
    (("pgd_epsilon: 0.5\n", ""), "'pgd_epsilon' is missing"),
    (("dataset: cifar10", "dataset: svhn"), "dataset 'svhn' is not one rebm knows"),
    (("model_type: WideResNet34x10", "model_type: ResNet50ImageNet"),
     "model_type 'ResNet50ImageNet' has no rebm config for cifar10"),
    (("fid_num_steps: 33", "fid_num_steps: many"), "'fid_num_steps' must be an integer, got 'many'"),
    (("method: \"dat\"", "method: jem"), "method 'jem' is not one rebm knows"),
])
def test_a_value_rebm_cannot_use_is_one_error_line(tmp_path, change, message):
    from rebm.eval.table.original_configs import original_tables

    path = tmp_path / "cifar10-dat.yaml"
    path.write_text(CIFAR10_T40_SEED0.replace(*change))
    with pytest.raises(TableError) as err:
        original_tables(str(path))
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------
# End to end, through the entry point, with a tiny protocol
# --------------------------------------------------------------------------------------------
def _env():
    return base_env(1, {"REBM_FID_FEATURES": STANDIN, "PYTHONPATH": str(REPO)})


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """(original project folder with model_configs/ and the checkpoints, tiny protocol table)."""
    import numpy as np

    from rebm.config import load_config
    from rebm.models import model_from_config

    tmp = tmp_path_factory.mktemp("original")
    write_fake_cifar10(str(tmp / "cifar"), n_train=50, n_test=40)
    features = np.random.default_rng(0).random((64, 15))  # stand-in features' statistics
    write_standin_statistics(tmp / "stats.npz", features.mean(0), np.cov(features, rowvar=False))
    overrides = [f"data.indist_ds_dir={tmp / 'cifar'}", "data.num_workers=0",
                 "model.model_type=WideResNet10x1", "eval.num_images=16",
                 "image_log.num_samples=10", "image_log.log_fid=true",
                 "image_log.seed_images=noise", f"image_log.data_dir={tmp / 'stats.npz'}"]
    protocol = {"title": "tiny protocol", "metrics": ["accuracy", "fid"], "batch_size": 8,
                "overrides": overrides,
                "rows": [{"name": "unused", "config": "x.yaml", "checkpoint": "x"}]}
    (tmp / "protocol.yaml").write_text(json.dumps(protocol))
    folder = _write(tmp / "model_configs", {
        "cifar10-dat-WideResNet34x10-T40-seed0.yaml": CIFAR10_T40_SEED0,
        "cifar10-dat-WideResNet34x10-T40-seed1.yaml": CIFAR10_T40_SEED1})
    cfg = load_config(str(REPO / "experiments/cifar10/cifar10-dat-WideResNet34x10-T40-seed0.yaml"),
                      ["model.model_type=WideResNet10x1", "model.ckpt_path=null"])
    for seed, run in ((0, "run-20250506_140002-4oni26z2"), (1, "run-20250502_142218-q4ccywk7")):
        torch.manual_seed(seed)
        model = torch.nn.DataParallel(model_from_config(cfg.model, cfg.data))  # saved as the original saved it
        path = tmp / "wandb/robust-ebms-2/wandb" / run / "files/model_bestfid.pth"
        path.parent.mkdir(parents=True)
        torch.save(model.state_dict(), path)
    return tmp, folder


def _table(args, timeout=300):
    return run_command([sys.executable, "-m", "rebm.eval.table", *map(str, args)],
                       timeout=timeout, env=_env())


def test_an_original_config_file_runs_as_a_one_row_table(project):
    tmp, folder = project
    file = folder / "cifar10-dat-WideResNet34x10-T40-seed0.yaml"
    out = tmp / "out-file"
    _table([file, "--checkpoints", tmp, "--protocol", tmp / "protocol.yaml", "--out", out]
           ).assert_ok()
    markdown = (out / "table.md").read_text()
    assert markdown.startswith("# cifar10-dat-WideResNet34x10-T40-seed0 (original model config; "
                               "protocol: tiny protocol)")
    row = [x for x in markdown.splitlines()
           if x.startswith("| cifar10-dat-WideResNet34x10-T40-seed0 |")][0]
    assert "–" not in row  # both metrics have their value
    cache = json.loads((out / "rows" / "cifar10-dat-WideResNet34x10-T40-seed0.json").read_text())
    assert cache["metrics"]["fid"]["settings"]["num_steps"] == 33  # fid_num_steps


def test_a_folder_of_original_configs_runs_as_a_table_and_check_lists_it(project):
    tmp, folder = project
    out = tmp / "out-folder"
    common = [folder, "--checkpoints", tmp, "--protocol", tmp / "protocol.yaml", "--out", out]
    _table([*common, "--metrics", "accuracy"]).assert_ok()
    markdown = (out / "table.md").read_text()
    assert "| cifar10-dat-WideResNet34x10-T40 | 0, 1 |" in markdown  # the seeds form a group

    shutil.rmtree(tmp / "wandb/robust-ebms-2/wandb/run-20250502_142218-q4ccywk7")
    check = _table([*common, "--check", "--verbose"])
    assert check.returncode == 1
    assert ("  MISSING  checkpoint: " + str(tmp / "wandb/robust-ebms-2/wandb/"
            "run-20250502_142218-q4ccywk7/files/model_bestfid.pth")) in check.output
    assert check.output.splitlines()[-1].endswith(
        "in row(s) cifar10-dat-WideResNet34x10-T40-seed1; nothing was computed")


def test_protocol_goes_with_original_configs_only(project):
    tmp, _ = project
    result = _table([tmp / "protocol.yaml", "--checkpoints", tmp, "--protocol",
                     tmp / "protocol.yaml"])
    assert result.returncode == 2
    assert result.output.strip() == (f"error: --protocol goes with original model configs; "
                                     f"{tmp / 'protocol.yaml'} is a table (its own protocol)")


def test_rows_pick_the_tables_before_metrics_are_checked(tmp_path):
    """A folder of several datasets: `--rows` picks the tables first, so a metric that only the
    CIFAR-10 protocol has works for a CIFAR-10 row, and a wrong one names the selected tables."""
    import argparse

    from rebm.eval.commands.table import load_tables, select_all
    from rebm.eval.table.spec import TableError

    folder = _write(tmp_path / "model_configs", ORIGINALS)
    specs = load_tables(str(folder))
    assert len(specs) == 2  # cifar10 and imagenet
    row = "cifar10-dat-WideResNet34x10-T40-seed0"
    args = argparse.Namespace(table=str(folder), rows=[row], metrics=["counterfactuals"])
    chosen = select_all(specs, args)
    assert [s.stem for s in chosen] == [specs[0].stem] and "counterfactuals" in chosen[0].metrics
    args.rows = ["imagenet-at-ConvNeXtLarge-convst-256x256"]
    with pytest.raises(TableError, match="'counterfactuals' is not a metric of the selected "
                                         "tables"):
        select_all(specs, args)
