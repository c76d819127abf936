"""The shipped recipes are the paper's training commands: each recipe under
experiments/{cifar10,cifar100,imagenet}/ read by rebm equals, on every key that changes the
experiment, the `train_cmd` of the original's model config it names (its experiments YAML plus the
command's overrides), also read by rebm (docs/recipes.md).

The original's values are data here, each with its file:line in xuwangyin/DAT at fb2ffc7 (CI has
no copy of the original): of each experiments YAML, the lines that set a key rebm reads and that
may not differ; the lines not listed set paths, workers, wandb, logging cadence (MAY_DIFFER) or
fields without effect in rebm (docs/configs.md, "ignored"), which no recipe sets.
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, Tuple

import pytest
import yaml

from rebm.config import ignored_fields_set, load_config, to_dict
from rebm.config.legacy import legacy_keys
from rebm.config.schema import TrainConfig
from tests.helpers import REPO

inf = math.inf

# Keys a recipe may set otherwise than the original: where files are, how data is loaded,
# tracking and logging cadence, and the memory layout (float rounding only, docs/performance.md).
MAY_DIFFER = frozenset({
    "data.indist_ds_dir", "data.outdist_std_dir", "model.ckpt_path",  # paths
    "data.num_workers",  # workers
    "wandb_project", "wandb_dir", "wandb_disabled", "wandb_mode", "tags",  # wandb
    "n_imgs_per_metrics_log", "n_imgs_per_image_log", "n_imgs_per_ckpt_save",  # logging cadence
    "model.channels_last",  # memory layout
})
IGNORED = frozenset(legacy_keys(TrainConfig))  # without effect in rebm: compared by absence

_C10 = ("experiments/cifar10/cifar10_conditional_r1reg0_augauto_innoutloader_steps40_bs128_"
        "indistxent_sgd_lr0.001_stesp50_wd_wrn3410_indistaugoriginal_innoutpretrained_mean0_"
        "bestavg_ema_logsumexp")
_C100 = ("experiments/cifar100/cifar100_conditional_r1reg0_augauto_innoutloader_steps40_bs128_"
         "indistxent_sgd_lr0.01_stesp50_wd_wrn3410_indistaugoriginal_innoutpretrained_mean0_"
         "bestavg_ema_logsumexp_bceweight1")
_IMNET = "experiments/imagenet/imagenet_indistonly_joint_"
_IMNET_TAIL = "_bs512_imagenetnormalization_newopenimages_stepsize2.0_ema_imglogsteps"


def _cifar(dataset: str, classes: int, lr: float, shift: int, **changed) -> Dict[str, Tuple]:
    """A CIFAR experiments YAML of the original: key -> (value, line). `shift`: the lines its
    image_log block adds after line 44 (the _weepsamples5120 file: 2)."""
    values = {
        "data.indist_dataset": (f"{dataset}-conditional", 2), "data.outdist_dataset":
        ("tinyimages", 5), "data.num_classes": (classes, 8), "attack.attack_type": ("pgd", 12),
        "attack.max_steps": (50, 13), "attack.start_step": (0, 15), "attack.step_size": (0.1, 16),
        "attack.eps": (inf, 17), "indist_attack_clf.attack_type": ("pgd", 20),
        "indist_attack_clf.max_steps": (10, 21), "indist_attack_clf.start_step": (10, 23),
        "indist_attack_clf.step_size": (0.1, 24), "indist_attack_clf.eps": (0.5, 25),
        "model.model_type": ("WideResNet34x10", 28), "model.normalize_input": (True, 31),
        "model.use_batchnorm": (False, 32), "image_log.num_steps": (32, 36),
        "image_log.step_size": (0.2, 37), "image_log.eps": (inf, 38),
        "image_log.log_fid": (True, 39),
        "image_log.data_dir": (f"./data/fid_stats/fid_stats_{dataset}_train.npz", 40),
        "image_log.ood_data_dir": ("./data/cifar_fid_imgs_50K.pt", 41),
        "image_log.num_samples": (10000, 43)}
    after = {"optimizer": ("sgd", 47), "wd": (0.0005, 48), "lr": (lr, 49), "r1reg": (0, 50),
             "batch_size": (128, 55), "AUC_th": (0.8, 57), "rand_seed": (0, 59),
             "samples_per_attack_step": (None, 61), "clf_indist_weight": (1.0, 63),
             "clf_outdist_weight": (0.0, 64), "clf_adv_weight": (1.0, 65),
             "min_imgs_per_threshold": (1000, 69), "n_imgs_per_evaluation_log": (50000, 74),
             "fp16": (False, 78), "robust_eval": (True, 79),
             "augm_type_classification": ("autoaugment_cutout", 80),
             "augm_type_generation": ("original", 81), "fixed_lr": (True, 85),
             "use_ema": (True, 89), "logsumexp": (True, 90)}
    values.update({key: (value, line + shift) for key, (value, line) in after.items()})
    values.update(changed)
    return values


def _imagenet(model: str, max_steps: int, img_steps: int, auc: float) -> Dict[str, Tuple]:
    """The ResNet-50 / WideResNet-50-4 experiments YAMLs of the original (the same lines)."""
    return {
        "data.indist_dataset": ("ImageNet", 2), "data.outdist_dataset": ("OpenImageO", 5),
        "data.num_classes": (1000, 8), "attack.attack_type": ("pgd", 11),
        "attack.max_steps": (max_steps, 12), "attack.start_step": (0, 14),
        "attack.step_size": (2.0, 15), "attack.eps": (inf, 16),
        "indist_attack_clf.attack_type": ("pgd", 20), "indist_attack_clf.max_steps": (3, 21),
        "indist_attack_clf.start_step": (3, 23), "indist_attack_clf.step_size": (2.0, 24),
        "indist_attack_clf.eps": (3.0, 25), "model.model_type": (model, 28),
        "model.normalize_input": (True, 31), "model.use_batchnorm": (False, 32),
        "image_log.num_steps": (img_steps, 36), "image_log.step_size": (8, 37),
        "image_log.eps": (inf, 38), "image_log.log_fid": (True, 39),
        "image_log.data_dir": ("./data/fid_stats/imagenet_train_stats.npz", 40),
        "image_log.ood_data_dir": ("./data/OpenImage-O-large/fid_eval", 41),
        "image_log.num_samples": (10000, 43), "image_log.adaptive_steps": (True, 46),
        "image_log.sweep_num_samples": (2560, 47), "optimizer": ("sgd", 51),
        "wd": (0.0005, 52), "lr": (0.001, 53), "r1reg": (0, 54), "batch_size": (512, 59),
        "AUC_th": (auc, 61), "rand_seed": (0, 63), "samples_per_attack_step": (None, 65),
        "clf_indist_weight": (1.0, 67), "clf_outdist_weight": (0.0, 68),
        "clf_adv_weight": (1.0, 69), "min_imgs_per_threshold": (1000, 73),
        "n_imgs_per_evaluation_log": (50000, 78), "fp16": (False, 82), "robust_eval": (True, 83),
        "augm_type_classification": ("default", 84), "augm_type_generation": ("generation_id", 85),
        "fixed_lr": (True, 89), "use_ema": (True, 93), "logsumexp": (True, 94),
        "openimages_max_samples": (300000, 98)}


_CONVNEXT = {  # experiments/imagenet/imagenet_indistonly_joint_convnext_300K.yaml
    "data.indist_dataset": ("ImageNet", 2), "data.outdist_dataset": ("OpenImageO", 5),
    "data.num_classes": (1000, 8), "attack.attack_type": ("pgd", 11),
    "attack.max_steps": (100, 12), "attack.start_step": (0, 14), "attack.step_size": (2.0, 15),
    "attack.eps": (inf, 16), "indist_attack_clf.attack_type": ("pgd", 20),
    "indist_attack_clf.norm": ("L2", 21), "indist_attack_clf.max_steps": (3, 22),
    "indist_attack_clf.start_step": (3, 24), "indist_attack_clf.step_size": (2.0, 25),
    "indist_attack_clf.eps": (3.0, 26), "model.model_type": ("convnext_small", 29),
    "model.normalize_input": (True, 32), "model.use_batchnorm": (False, 33),
    "model.use_layernorm": (True, 34), "model.use_convstem": (True, 35),
    "image_log.num_steps": (22, 39), "image_log.step_size": (8, 40), "image_log.eps": (inf, 41),
    "image_log.log_fid": (True, 42),
    "image_log.data_dir": ("./data/fid_stats/imagenet_train_stats.npz", 43),
    "image_log.ood_data_dir": ("./data/OpenImage-O-large/fid_eval", 44),
    "image_log.num_samples": (10000, 46), "image_log.adaptive_steps": (True, 49),
    "image_log.sweep_radius": (3, 50), "image_log.sweep_num_samples": (2560, 51),
    "optimizer": ("sgd", 55), "wd": (0.0005, 56), "lr": (0.001, 57), "r1reg": (0, 58),
    "batch_size": (512, 63), "AUC_th": (0.5, 65), "rand_seed": (0, 67),
    "samples_per_attack_step": (None, 69), "clf_indist_weight": (1.0, 71),
    "clf_outdist_weight": (0.0, 72), "clf_adv_weight": (1.0, 73),
    "min_imgs_per_threshold": (1000, 77), "n_imgs_per_evaluation_log": (50000, 82),
    "fp16": (False, 86), "robust_eval": (True, 87), "augm_type_classification": ("default", 88),
    "augm_type_generation": ("generation_id", 89), "fixed_lr": (True, 93),
    "use_ema": (True, 97), "logsumexp": (True, 98), "openimages_max_samples": (300000, 102)}

EXPERIMENTS = {  # the original's experiments YAMLs the train_cmds run: path -> values
    f"{_C10}_seed1.yaml": _cifar("cifar10", 10, 0.001, 0, rand_seed=(1, 59)),
    f"{_C10}_seed2_aucth0.7_maxsteps100_imglogsteps35.yaml": _cifar(
        "cifar10", 10, 0.001, 0, rand_seed=(2, 59), AUC_th=(0.7, 57),
        **{"attack.max_steps": (100, 13), "image_log.num_steps": (35, 36)}),
    f"{_C100}.yaml": _cifar("cifar100", 100, 0.01, 0),
    f"{_C100}_weepsamples5120_aucth0.75.yaml": _cifar(
        "cifar100", 100, 0.01, 2, AUC_th=(0.75, 59),
        **{"image_log.adaptive_steps": (True, 45), "image_log.sweep_num_samples": (5120, 46)}),
    f"{_IMNET}resnet50{_IMNET_TAIL}15_sweepsamples2560_300K.yaml":
        _imagenet("ResNet50ImageNet", 50, 15, 0.7),
    f"{_IMNET}wrn50x4{_IMNET_TAIL}20_sweepsamples2560_300K.yaml":
        _imagenet("WideResNet50x4ImageNet", 100, 20, 0.5),
    f"{_IMNET}convnext_300K.yaml": _CONVNEXT,
}

# model_configs/<name>.yaml -> (the experiments YAML of its train_cmd (line), the command's
# overrides as it writes them, each with its line)
_SEED_OVERRIDES = lambda seed: ((f"rand_seed={seed}", 11), ("image_log.log_fid=true", 12))  # noqa: E731
_CNX_OVERRIDES = (  # model_configs/imagenet-dat-ConvNeXtLarge-convst-256x256-stepsize3.yaml
    ("model.model_type=convnext_large", 10),
    ("model.ckpt_path=checkpoints/convnext_large_cvst_robust.pt", 11), ("optimizer=adamw", 12),
    ("wd=0.05", 13), ("lr=0.001", 14), ("image_log.log_fid=true", 15),
    ("image_log.adaptive_steps=true", 16), ("image_log.num_steps=22", 17),
    ("image_log.sweep_radius=3", 18), ("AUC_th=0.2", 19), ("model.normalize_input=false", 20),
    ("data.image_size=256", 21), ("attack.step_size=3.0", 22))
_IMNET_OVERRIDES = lambda auc, steps, line: (  # noqa: E731
    (f"AUC_th={auc}", line), ("data.image_size=256", line + 1),
    (f"attack.max_steps={steps}", line + 2))
_R50, _W504 = list(EXPERIMENTS)[4:6]
MODEL_CONFIGS = {
    **{f"cifar10-dat-WideResNet34x10-T40-seed{s}": ((f"{_C10}_seed1.yaml", 10),
                                                      _SEED_OVERRIDES(s)) for s in range(3)},
    "cifar10-dat-WideResNet34x10-T50": (
        (f"{_C10}_seed2_aucth0.7_maxsteps100_imglogsteps35.yaml", 8), ()),
    **{f"cifar100-dat-WideResNet34x10-T45-seed{s}": ((f"{_C100}.yaml", 10), _SEED_OVERRIDES(s))
       for s in range(3)},
    "cifar100-dat-WideResNet34x10-T50": ((f"{_C100}_weepsamples5120_aucth0.75.yaml", 7), ()),
    "imagenet-dat-ResNet50ImageNet-T15-256x256": ((_R50, 9), _IMNET_OVERRIDES(0.4, 15, 10)),
    "imagenet-dat-ResNet50ImageNet-T30-256x256": ((_R50, 7), _IMNET_OVERRIDES(0.4, 30, 8)),
    "imagenet-dat-WideResNet50x4ImageNet-T30-256x256": ((_W504, 9),
                                                        _IMNET_OVERRIDES(0.2, 30, 10)),
    "imagenet-dat-WideResNet50x4ImageNet-T65-256x256": ((_W504, 9),
                                                        _IMNET_OVERRIDES(0.2, 65, 10)),
    "imagenet-dat-ConvNeXtLarge-convst-256x256-stepsize3": ((f"{_IMNET}convnext_300K.yaml", 9),
                                                            _CNX_OVERRIDES),
}
FOLDERS = ("cifar10", "cifar100", "imagenet")
NOT_A_PAPER_ROW = {"dat_resnet50_224px.yaml"}  # the 224 px ImageNet recipe
_NAMED = re.compile(r"model_configs/([A-Za-z0-9_.-]+?)\.yaml")


def recipe_path(name: str):
    return REPO / "experiments" / name.split("-", 1)[0] / f"{name}.yaml"


def _flat(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _original(name: str, tmp_path):
    """The model config's train_cmd, read by rebm: its experiments YAML (written back from the
    data above) with the command's overrides."""
    (experiments, _), overrides = MODEL_CONFIGS[name]
    tree: Dict[str, Any] = {}
    for key, (value, _line) in EXPERIMENTS[experiments].items():
        *sections, leaf = key.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    path = tmp_path / experiments.rsplit("/", 1)[-1]
    path.write_text(yaml.safe_dump(tree))
    return load_config(str(path), [item for item, _line in overrides])


def differences(recipe, original) -> Dict[str, Tuple[Any, Any]]:
    """key -> (recipe's, original's) on every key that changes the experiment."""
    mine, theirs = _flat(to_dict(recipe)), _flat(to_dict(original))
    assert mine.keys() == theirs.keys()
    return {key: (mine[key], theirs[key]) for key in mine
            if key not in MAY_DIFFER and key not in IGNORED and mine[key] != theirs[key]}


@pytest.mark.parametrize("name", sorted(MODEL_CONFIGS))
def test_recipe_is_the_train_cmd_of_its_model_config(name, tmp_path):
    recipe = load_config(str(recipe_path(name)))
    assert differences(recipe, _original(name, tmp_path)) == {}
    assert ignored_fields_set(recipe) == []  # it sets no field without effect


def test_exactly_one_recipe_per_model_config():
    """Each recipe names, in its text, the model config it reproduces; each of the 13 is named by
    exactly one recipe, the file of its own name; the recipes that stand for no paper row say so
    in their first line."""
    named: Dict[str, list] = {name: [] for name in MODEL_CONFIGS}
    recipes = sorted(p for folder in FOLDERS for p in (REPO / "experiments" / folder).glob("*.yaml"))
    for path in recipes:
        for found in set(_NAMED.findall(path.read_text())):
            if found in named:
                named[found].append(path)
    assert named == {name: [recipe_path(name)] for name in MODEL_CONFIGS}
    assert {p.name for p in recipes} == {f"{n}.yaml" for n in MODEL_CONFIGS} | NOT_A_PAPER_ROW
    for name in NOT_A_PAPER_ROW:
        first = (REPO / "experiments" / "imagenet" / name).read_text().splitlines()[0]
        assert "no paper row" in first, first


_CHOICES = {"sgd": "adam", "adamw": "sgd", "autoaugment_cutout": "none", "original": "none",
            "default": "madry", "generation_id": "generation_id_randomcrop", "L2": "Linf",
            "tinyimages": "noise", "OpenImageO": "noise", "cifar10-conditional": "cifar10",
            "cifar100-conditional": "cifar100", "ImageNet": "imagefolder",
            "WideResNet34x10": "WideResNet28x10", "ResNet50ImageNet": "WideResNet50x4ImageNet",
            "WideResNet50x4ImageNet": "ResNet50ImageNet", "convnext_large": "convnext_base",
            "auto": "gloo"}
# one valid value in rebm (any other is refused at load), so no recipe can differ there
_FIXED = {"attack.attack_type", "indist_attack_clf.attack_type", "image_log.attack_type",
          "fixed_lr"}


def _changed(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return 1.0 if math.isinf(value) else (value / 2 if value else 0.25)
    if value is None:
        return 7
    return _CHOICES.get(value, f"{value}.changed")


@pytest.mark.parametrize("name", sorted(MODEL_CONFIGS))
def test_a_changed_value_in_a_recipe_fails(name, tmp_path):
    """A copy of the recipe with every value that may not differ changed at once: the comparison
    names each of them (so it compares every one), and only them."""
    raw = yaml.safe_load(recipe_path(name).read_text())
    flat = _flat(raw)
    changed = {key for key in flat if key not in MAY_DIFFER and key not in _FIXED}
    assert len(changed) >= 35  # the recipe sets what it compares
    for key in changed:
        *sections, leaf = key.split(".")
        node = raw
        for section in sections:
            node = node[section]
        node[leaf] = _changed(node[leaf])
    copy = tmp_path / f"{name}.yaml"
    copy.write_text(yaml.safe_dump(raw))
    found = differences(load_config(str(copy)), _original(name, tmp_path))
    assert set(found) == {"image_log.seed_images" if k == "image_log.ood_data_dir" else k
                          for k in changed}
