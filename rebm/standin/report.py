"""What a stand-in run exercised, read back from what its stages wrote (metrics.jsonl, the model
files, samples/, wandb/), and the files a real run of the recipe reads, each with where it comes
from (the sources the paper tables' `--check` names, rebm.eval.table.paths)."""

from __future__ import annotations

import glob
import json
import os
from typing import Dict, List, Tuple

from rebm.config import TrainConfig, load_config
from rebm.config.datasets import OUTDIST_ROLE, dataset_reads_files, indist_root_files
from rebm.eval.features.fid import weights_files
from rebm.eval.sampling.samples import sample_files
from rebm.eval.table.paths import data_source
from rebm.standin.data import tinyimages_file
from rebm.standin.recipes import TINYIMAGES, TRAIN_AT, Recipe, Stage

RECORD_KEYS = ("step", "n_imgs", "epoch")
METHOD = {1: "adversarial training (train_at.py)", 2: "DAT (rebm.training.train)"}


def read_records(run_dir: str) -> Tuple[List[dict], List[dict]]:
    """(training records, evaluation records) of a run's metrics.jsonl."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    return ([r for r in records if "test_acc" not in r], [r for r in records if "test_acc" in r])


def attack_text(attack) -> str:
    return (f"{attack.attack_type} {attack.norm} eps {attack.eps:g} step {attack.step_size:g}, "
            f"{attack.max_steps} step(s)")


def curriculum_text(stage: Stage, train: List[dict], original: TrainConfig) -> str:
    """T at the start and at the end, and the rule that moved it (or did not)."""
    method = stage.cfg.method
    reached = max((r["cur_outdist_steps"] for r in train), default=method.attack.start_step)
    aucs = [r["train_adv_auc"] for r in train]
    last = f"; last AUC {aucs[-1]:.3f}" if aucs else ""
    return (f"curriculum T {method.attack.start_step} -> {reached} (cap {original.method.attack.max_steps},"
            f" AUC_th {method.AUC_th:g} over a window of "
            f"{method.min_imgs_per_threshold} images{last})")


def model_files_text(run_dir: str, stage: int) -> str:
    names = ("model_bestacc.pth", "model_bestfid.pth", "model_final.pth")
    written = [n for n in names if os.path.exists(os.path.join(run_dir, n))]
    text = f"written: {', '.join(written)}"
    if stage == 2 and "model_bestfid.pth" not in written:
        text += ("; model_bestfid.pth is picked by the Inception FID only (stand-in values never "
                 "pick a model)")
    return text


def stage_lines(stage: Stage, recipe: Recipe, folder: str) -> List[str]:
    run_dir = os.path.join(folder, stage.run_dir)
    train, evaluations = read_records(run_dir)
    cfg = stage.cfg
    original = recipe.original if stage.number == 2 else load_config(str(stage.config), [])
    lines = [f"stage {stage.number}, {METHOD[stage.number]}: {len(train)} steps on "
             f"{cfg.data.indist_dataset} stand-in data, run_dir {stage.run_dir}",
             f"  model {original.model.model_type} family as {cfg.model.model_type}",
             f"  classifier attack {attack_text(cfg.method.indist_attack_clf)}"]
    if stage.number == 2:
        lines += [f"  negatives' attack {attack_text(cfg.method.attack)} from "
                  f"{cfg.data.outdist_dataset}; {curriculum_text(stage, train, original)}"]
    keys = sorted({k for r in evaluations for k in r} - set(RECORD_KEYS))
    steps = ", ".join(str(r["step"]) for r in evaluations)
    lines.append(f"  evaluations at steps {steps}: {', '.join(keys)}")
    fid = [r["fid_standin"] for r in evaluations if "fid_standin" in r]
    if fid:
        lines.append(f"  FID on stand-in features (fid_standin) {fid[-1]:.4g} against "
                     f"{cfg.image_log.data_dir}")
    lines.append(f"  best-model files {model_files_text(run_dir, stage.number)}")
    samples = glob.glob(os.path.join(run_dir, "samples", "*"))
    wandb = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*"))
    lines.append(f"  samples/: {len(samples)} file(s); wandb offline runs: {len(wandb)}")
    return lines


def exercised_lines(recipe: Recipe, folder: str) -> List[str]:
    lines: List[str] = []
    for stage in recipe.stages:
        lines += stage_lines(stage, recipe, folder)
    return lines


def stage_files(cfg: TrainConfig, stage: int) -> Dict[str, str]:
    """{config key: path} of what a real run of this stage reads."""
    files: Dict[str, str] = dict(indist_root_files(cfg.data))
    if stage == 1:  # the classifier stream only
        return files
    data = cfg.data
    if data.outdist_dataset in TINYIMAGES:
        files["data.outdist_std_dir"] = tinyimages_file(data)
        if data.tinyimages_exclusion_dir:
            files["data.tinyimages_exclusion_dir"] = data.tinyimages_exclusion_dir
    elif dataset_reads_files(OUTDIST_ROLE, data.outdist_dataset):
        files["data.outdist_std_dir"] = data.outdist_std_dir
    if cfg.image_log.log_fid:
        files["image_log.data_dir"] = cfg.image_log.data_dir
        files.update(weights_files(cfg.image_log))
    files.update(sample_files(cfg.evaluation))
    if cfg.model.ckpt_path:
        files["model.ckpt_path"] = cfg.model.ckpt_path
    return files


def source_of(key: str, path: str, recipe: Recipe) -> str:
    if key == "model.ckpt_path":
        stage1 = [s for s in recipe.stages if s.number == 1]
        if stage1:
            script = os.path.relpath(TRAIN_AT)
            return (f"stage 1: torchrun --nproc_per_node=N {script} "
                    f"{os.path.relpath(stage1[0].config)}")
        return ("the public robust checkpoint of its model family (docs/imagenet.md, "
                "Checkpoints)")
    if key == "image_log.data_dir":
        return (f"python -m rebm.eval.fid_stats {os.path.relpath(recipe.path)} --out {path} "
                f"(with the data and the Inception weights), or {data_source(path)}")
    return data_source(path)


def needed_files_lines(recipe: Recipe) -> List[str]:
    """Each file a real run of the recipe reads once, present or MISSING here, and its source."""
    seen: Dict[str, Tuple[str, str]] = {}
    for stage in recipe.stages:
        original = recipe.original if stage.number == 2 else load_config(str(stage.config), [])
        for key, path in stage_files(original, stage.number).items():
            seen.setdefault(os.path.normpath(path), (key, path))
    lines = []
    for normalized, (key, path) in seen.items():
        state = "present" if os.path.exists(path) else "MISSING"
        lines.append(f"{state:8} {normalized} ({key})")
        lines.append(f"           from {source_of(key, normalized, recipe)}")
    return lines
