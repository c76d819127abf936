"""The original's files where the original put them: the shipped configs and the paper tables
read the FID statistics and seed images at the original's paths, so an existing data/ folder, or
the original's checkout passed as --checkpoints, works as it is; the paper tables evaluate the
weights as the original's templates did (use_ema false); ImageNet training sweeps the original's
+-3 steps. The original's values are those of xuwangyin/DAT at fb2ffc7 (file:line below)."""

from __future__ import annotations

import sys

import pytest

from rebm.config import load_config
from rebm.eval.table.paths import DATA_SOURCES
from rebm.eval.table.spec import load_table, row_sections
from tests.helpers import REPO, TRAINING_CONFIGS, base_env, finish, run_command
from tests.processes import popen
from tests.test_table_original import CIFAR10_T40_SEED1, IMAGENET_DAT_CONVNEXT_BASE, ORIGINALS

# image_log.data_dir of the original's configs: experiments/cifar10/eval_fid/
# cifar10_conditional_wrn3410_eval_fid_steps33.yaml:39, experiments/cifar100/eval_fid/
# cifar100_conditional_wrn3410_eval_fid.yaml:39, experiments/imagenet/
# imagenet_indistonly_joint_resnet50timm_fid_50Ksamples_newopenimages.yaml:41 (and every
# training config of each dataset)
ORIGINAL_STATS = {"cifar10": "./data/fid_stats/fid_stats_cifar10_train.npz",
                  "cifar100": "./data/fid_stats/fid_stats_cifar100_train.npz",
                  "imagenet": "./data/fid_stats/imagenet_train_stats.npz"}
# image_log.ood_data_dir, the seed images: line 40 of the CIFAR FID templates, 42 of ImageNet's
ORIGINAL_SEEDS = {"cifar10": "./data/cifar_fid_imgs_50K.pt",
                  "cifar100": "./data/cifar_fid_imgs_50K.pt",
                  "imagenet": "./data/OpenImage-O-large/fid_eval"}
DATASET_CONFIGS = [p for p in TRAINING_CONFIGS if p.parent.name in ORIGINAL_STATS]
PAPER_TABLES = sorted((REPO / "experiments" / "paper").glob("*.yaml"))


@pytest.mark.parametrize("path", DATASET_CONFIGS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_shipped_configs_read_the_statistics_where_the_original_put_them(path):
    cfg = load_config(str(path))
    dataset = path.parent.name
    assert cfg.image_log.data_dir == ORIGINAL_STATS[dataset]
    if dataset == "imagenet":
        assert cfg.image_log.seed_images == ORIGINAL_SEEDS[dataset]
        # the original's ConvNeXt config sets 3 (imagenet_indistonly_joint_convnext_300K.yaml:50),
        # its other ImageNet configs none: ImageLogConfig's default, 3 (config_classes.py:44)
        assert cfg.image_log.sweep_radius == 3


@pytest.mark.parametrize("table", PAPER_TABLES, ids=lambda p: p.stem)
def test_paper_tables_evaluate_the_weights_as_the_original(table):
    """Every row's every metric, as the table runner loads it: use_ema false, as both ImageNet
    FID templates (line 90) and config_classes.py:158 (the CIFAR templates set none); the
    sample metrics read the original's statistics and seeds."""
    spec = load_table(str(table))
    configs = row_sections(spec, "checkpoints")
    for row in spec.rows:
        for metric, cfg in configs[row.name].items():
            assert cfg.ema.use_ema is False, (row.name, metric)
            dataset = "imagenet" if cfg.data.indist_dataset == "ImageNet" else \
                cfg.data.indist_dataset.removesuffix("-conditional")
            if metric == "fid":
                assert cfg.image_log.data_dir == ORIGINAL_STATS[dataset], row.name
                assert cfg.image_log.seed_images == ORIGINAL_SEEDS[dataset], row.name


@pytest.mark.parametrize("table, row, statistics, seeds", [
    ("cifar10", "dat-t40-seed0", "fid_stats_cifar10_train.npz", "cifar_fid_imgs_50K.pt"),
    ("cifar100", "dat-t45-seed0", "fid_stats_cifar100_train.npz", "cifar_fid_imgs_50K.pt"),
    ("imagenet256", "dat-resnet50-t15-256", "imagenet_train_stats.npz",
     "OpenImage-O-large/fid_eval"),
])
def test_the_original_checkout_as_checkpoints_folder_works_as_it_is(table, row, statistics,
                                                                     seeds, tmp_path):
    """Files at the original's places under --checkpoints (its README.md:16 puts the "FID data"
    under the project folder): --check finds them there."""
    path = REPO / "experiments" / "paper" / f"{table}.yaml"
    checkpoint = tmp_path / next(r.checkpoint for r in load_table(str(path)).rows
                                 if r.name == row)
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"weights")
    (tmp_path / "data" / "fid_stats").mkdir(parents=True)
    (tmp_path / "data" / "fid_stats" / statistics).write_bytes(b"statistics")
    seed_path = tmp_path / "data" / seeds
    if seeds.endswith(".pt"):
        seed_path.write_bytes(b"seeds")
    else:
        seed_path.mkdir(parents=True)
    result = run_command([sys.executable, "-m", "rebm.eval.table", str(path), "--checkpoints",
                          str(tmp_path), "--rows", row, "--metrics", "fid", "--check",
                          "--verbose"],
                         timeout=120, env=base_env(1))
    lines = result.output.splitlines()
    assert lines[0] == (f"relative data paths: looked up in {tmp_path} (--checkpoints) first, "
                        f"then in {REPO} (the current directory)"), result.output
    assert f"  present  checkpoint: {checkpoint}" in lines
    assert (f"  present  image_log.data_dir: {tmp_path / 'data' / 'fid_stats' / statistics}"
            "  [fid]") in lines, result.output
    kind = "" if seeds.endswith(".pt") else " (folder)"
    assert f"  present  image_log.seed_images: {seed_path}{kind}  [fid]" in lines, result.output
    assert "Traceback" not in result.output


def _check(folder, root, here, torch_home, *extra):
    """(exit code, stdout and stderr lines) of --check over the original's configs, run in
    `here` (relative data paths are looked up under `root`, then there)."""
    cmd = [sys.executable, "-m", "rebm.eval.table", str(folder), "--checkpoints", str(root),
           "--check", *extra]
    code, output = finish(popen(cmd, base_env(1, {"TORCH_HOME": str(torch_home)}), here), 180)
    assert "Traceback" not in output, output
    return code, output.splitlines()


def test_check_of_the_original_configs_says_once_what_to_fetch_and_where_it_goes(tmp_path):
    """Issue 40: each missing file once, as the absolute path it goes to, with the folders
    looked in, the rows and metrics that need it, under where the original distributes it; no
    per-row listing without --verbose; a short last line."""
    folder = tmp_path / "model_configs"
    folder.mkdir()
    originals = {**ORIGINALS, "cifar10-dat-WideResNet34x10-T40-seed1.yaml": CIFAR10_T40_SEED1,
                 "imagenet-dat-ConvNeXtBase-convst.yaml": IMAGENET_DAT_CONVNEXT_BASE,
                 # the original's 224 px file of the same checkpoint as the 256 px one
                 "imagenet-at-ConvNeXtLarge-convst.yaml": ORIGINALS[
                     "imagenet-at-ConvNeXtLarge-convst-256x256.yaml"].replace("256", "224")}
    for name, text in originals.items():
        (folder / name).write_text(text)
    root, here, torch_home = tmp_path / "original", tmp_path / "here", tmp_path / "torch"
    root.mkdir()
    here.mkdir()
    code, lines = _check(folder, root, here, torch_home)
    assert code == 1, "\n".join(lines)
    looked = f"(looked in {root}, then {here})"
    dropbox = next(i for i, x in enumerate(lines) if x.startswith("from the original's Dropbox"))
    assert DATA_SOURCES[0][1] in lines[dropbox] and "README.md:16" in lines[dropbox]
    convnext = f"  {root / 'checkpoints/convnext_large_cvst_robust.pt'}  [rows "
    assert [x for x in lines if x.startswith(convnext)] == [
        convnext + "imagenet-at-ConvNeXtLarge-convst-256x256, imagenet-at-ConvNeXtLarge-convst]"]
    statistics = (f"  {root / 'data/fid_stats/fid_stats_cifar10_train.npz'} {looked}  "
                  "[fid of all 2 rows of model_configs-cifar10]")
    assert lines.index(statistics) > dropbox, "\n".join(lines)
    seeds = (f"  {root / 'data/OpenImage-O-large/fid_eval'} {looked}  [fid, inception_score, "
             "precision_recall of all 5 rows of model_configs-imagenet]")
    source = lines[lines.index(seeds) - 1]
    assert source.startswith("from the original's data/OpenImage-O-large/README.md"), source
    weights = torch_home / "hub/checkpoints/pt_inception-2015-12-05-6726825d.pth"
    assert [x for x in lines if str(weights) in x] == [
        f"  {weights}  [counterfactuals, fid, inception_score, precision_recall of every row (7)]"]
    assert sum("imagenet_train_stats.npz" in x for x in lines) == 1  # once for 5 rows
    assert not [x for x in lines if x.startswith("row ") or "MISSING" in x or "present" in x]
    assert lines[-1].startswith("check: ") and lines[-1].endswith(
        "files missing, 0 other problem(s), in 7 of 7 rows (named above); nothing was computed")

    # found under --checkpoints: not missing; not statistics either, the row's own problem
    (root / "data/fid_stats").mkdir(parents=True)
    (root / "data/fid_stats/fid_stats_cifar10_train.npz").write_bytes(b"statistics")
    row = ("--rows", "cifar10-dat-WideResNet34x10-T40-seed1")
    code, lines = _check(folder, root, here, torch_home, *row)
    assert code == 1 and not [x for x in lines if "fid_stats_cifar10_train.npz (looked" in x]
    problem = [x for x in lines if x.startswith("problem [fid] image_log.data_dir ")]
    assert len(problem) == 1 and problem[0].endswith(f"  [row {row[1]}]"), "\n".join(lines)
    assert lines[-1] == (f"check: 14 of 15 files missing, 1 other problem(s), in row(s) {row[1]}; "
                         "nothing was computed")
    code, verbose = _check(folder, root, here, torch_home, "--verbose", *row)
    assert code == 1 and f"row {row[1]}:" in verbose and verbose[-1] == lines[-1]
    assert (f"  present  image_log.data_dir: {root / 'data/fid_stats/fid_stats_cifar10_train.npz'}"
            "  [fid]") in verbose
    assert [x for x in verbose if x.startswith(f"  MISSING  checkpoint: {root / 'wandb'}/")]
