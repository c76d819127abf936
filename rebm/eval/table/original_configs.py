"""The original DAT code's model configs (its `model_configs/*.yaml`) as tables of the table runner.

    python -m rebm.eval.table ORIGINAL/model_configs/cifar10-dat-WideResNet34x10-T40-seed0.yaml \\
        --checkpoints ORIGINAL [--protocol TABLE]
    python -m rebm.eval.table ORIGINAL/model_configs --checkpoints ORIGINAL

A file is a one-row table; a folder is one table per dataset, rows sorted by file name. The table
takes the protocol of its dataset, that is the metrics, batch_size, overrides, metric_overrides
and columns of the shipped paper table (`PROTOCOL_TABLES`; `--protocol TABLE` names another), and
the row is built from the file's keys as the original's evaluation scripts read them
(xuwangyin/DAT at fb2ffc7: run_fid_eval.py, run_acc_eval.py, evaluate_imagenet_robustbench.py,
eval_utils.py and the four FID templates its model configs name). Each decision below names the
original's file. A key rebm does not honour, or does not know, is one notice line naming the file
and the key; a value it cannot use (an unknown dataset or model type) is one error line.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from rebm.eval.metric import SAMPLES
from rebm.eval.registry import metric_classes
from rebm.eval.table.spec import RowSpec, TableError, TableSpec, load_table, read_mapping

REPO = Path(__file__).resolve().parents[3]

# eval_utils.py load_yaml_config requires method, dataset, checkpoint, model_type;
# run_fid_eval.py load_fid_yaml_config adds fid_eval_config and fid_num_steps;
# run_acc_eval.py load_acc_yaml_config adds pgd_epsilon
REQUIRED_KEYS = ("method", "dataset", "checkpoint", "model_type", "fid_eval_config",
                 "fid_num_steps", "pgd_epsilon")
OPTIONAL_KEYS = ("image_size", "ood_data_dir", "threat_model")
INFORMATIONAL_KEYS = ("train_cmd", "notes")  # read by nothing in the original's evaluation
# the original's methods; standard AT and RATIO are the paper's baselines
METHODS = {"at": ("Standard AT", True), "dat": ("DAT", False), "ratio": ("RATIO", True)}
PROTOCOL_TABLES = {"cifar10": "experiments/paper/cifar10.yaml",
                   "cifar100": "experiments/paper/cifar100.yaml",
                   "imagenet": "experiments/paper/imagenet256.yaml"}
# the rebm config each (dataset, model_type) row is read with: its model, data and attacks
CIFAR_CONFIGS = {"cifar10": "experiments/cifar10/cifar10-dat-WideResNet34x10-T40-seed0.yaml",
                 "cifar100": "experiments/cifar100/cifar100-dat-WideResNet34x10-T45-seed0.yaml"}
CIFAR_MODELS = ("WideResNet34x10",)
IMAGENET_CONFIGS = {
    "ResNet50ImageNet": "experiments/imagenet/dat_resnet50_224px.yaml",
    "WideResNet50x4ImageNet":
        "experiments/imagenet/imagenet-dat-WideResNet50x4ImageNet-T30-256x256.yaml"}
CONVNEXT_CONFIG = "experiments/imagenet/imagenet-dat-ConvNeXtLarge-convst-256x256-stepsize3.yaml"
CONVNEXTS = ("convnext_small", "convnext_base", "convnext_large")
# evaluate_imagenet_robustbench.py load_custom_model builds resnet50, wide_resnet50_4 and
# convnext_large only; run_acc_eval.py submit_job raises "Unsupported ImageNet model type" for
# any other (its model_type_mapping)
ORIGINAL_ACCURACY_MODELS = ("ResNet50ImageNet", "WideResNet50x4ImageNet", "convnext_large")
# run_acc_eval.py: --threat_model choices
THREAT_MODELS = ("L2", "Linf")


@dataclass(frozen=True)
class FidTemplate:
    """What the original's FID template (`fid_eval_config`) fixes that a model config does not:
    run_fid_eval.py passes only ckpt_path, num_samples, num_steps, batch_size, model_type and
    ood_data_dir (run_fid_eval.py lines 147-159), so the rest comes from the template."""

    dataset: str
    image_size: Optional[int]  # data.image_size of the samples (None: the dataset's own)
    normalize_input: bool  # model.normalize_input


FID_TEMPLATES = {
    # no data.image_size (CIFAR images are 32 px); model.normalize_input: true (line 30)
    "experiments/cifar10/eval_fid/cifar10_conditional_wrn3410_eval_fid_steps33.yaml":
        FidTemplate("cifar10", None, True),
    "experiments/cifar100/eval_fid/cifar100_conditional_wrn3410_eval_fid.yaml":
        FidTemplate("cifar100", None, True),
    # data.image_size: 256 (line 9), model.normalize_input: true (line 32), use_ema: false (90)
    "experiments/imagenet/imagenet_indistonly_joint_resnet50timm_fid_50Ksamples_newopenimages.yaml":
        FidTemplate("imagenet", 256, True),
    # data.image_size: 256 (line 9), model.normalize_input: false (line 32), use_ema: false (90)
    "experiments/imagenet/imagenet_indistonly_joint_convnext_fid_50Ksamples_newopenimages.yaml":
        FidTemplate("imagenet", 256, False),
}
_SEED = re.compile(r"[-_]seed(\d+)$")
_TRAIN_SEED = re.compile(r"\brand_seed=(\d+)\b")


def is_original_config(raw: Dict[str, Any]) -> bool:
    """Whether a YAML mapping is an original model config rather than a table."""
    return "rows" not in raw and "model_type" in raw and "method" in raw


def _text(value: Any) -> str:
    return " ".join(str(value or "").split())


def _number(raw: Dict[str, Any], key: str, path: str, kind: type) -> Any:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            kind is int and not isinstance(value, int)):
        what = "an integer" if kind is int else "a number"
        raise TableError(f"{path}: '{key}' must be {what}, got {value!r}")
    return value


def _choice(raw: Dict[str, Any], key: str, choices: Sequence[str], path: str) -> str:
    value = str(raw[key])
    if value not in choices:
        raise TableError(f"{path}: {key} '{value}' is not one rebm knows; use one of "
                         f"{', '.join(choices)}")
    return value


def _row_config(dataset: str, model_type: str, path: str) -> str:
    known = CIFAR_MODELS if dataset in CIFAR_CONFIGS else (*IMAGENET_CONFIGS, *CONVNEXTS)
    if model_type not in known:
        raise TableError(f"{path}: model_type '{model_type}' has no rebm config for {dataset}; "
                         f"use one of {', '.join(known)}")
    if dataset in CIFAR_CONFIGS:
        return CIFAR_CONFIGS[dataset]
    return IMAGENET_CONFIGS.get(model_type, CONVNEXT_CONFIG)


def _model_overrides(raw: Dict[str, Any], template: Optional[FidTemplate], path: str,
                     notices: List[str]) -> List[str]:
    model_type, dataset = str(raw["model_type"]), str(raw["dataset"])
    # the original evaluates one plain state dict: its FID templates set use_ema: false (line 90
    # of the ImageNet ones; config_classes.py's default, false, for CIFAR), and
    # evaluate_imagenet_robustbench.py loads the file as it is
    overrides = ["use_ema=false"]
    if model_type in CONVNEXTS:
        # evaluate_imagenet_robustbench.py load_custom_model (lines 70-77): ConvStem, no input
        # normalisation (the checkpoints expect [0, 1] inputs); the ConvNeXt FID template sets
        # normalize_input: false, and config_classes.py's ConvNextConfig use_convstem: true
        overrides += [f"model.model_type={model_type}", "model.use_convstem=true",
                      "model.normalize_input=false"]
        if template is not None and template.normalize_input:
            notices.append(f"{path}: fid_eval_config names a template with normalize_input: "
                           f"true for a {model_type}; rebm samples without input normalisation, "
                           "as the checkpoint was trained (its train_cmd: "
                           "model.normalize_input=false)")
        if model_type not in ORIGINAL_ACCURACY_MODELS:
            notices.append(f"{path}: model_type {model_type}: the original's run_acc_eval.py "
                           "has no accuracy evaluation for it; rebm evaluates it as the "
                           "original does convnext_large (ConvStem, no input normalisation)")
    elif dataset == "imagenet":
        # evaluate_imagenet_robustbench.py asserts normalize_input for the ResNets (line 148)
        overrides.append("model.normalize_input=true")
    return overrides


def _image_size_overrides(raw: Dict[str, Any], path: str, notices: List[str]) -> List[str]:
    dataset = str(raw["dataset"])
    if "image_size" not in raw:
        if dataset == "imagenet":
            notices.append(f"{path}: image_size is not set (the original's eval_utils.py "
                           "refuses an ImageNet config without it); the protocol table's size "
                           "is used")
        return []
    size = _number(raw, "image_size", path, int)
    if dataset != "imagenet":
        notices.append(f"{path}: image_size {size} is not used: the original passes it to "
                       "ImageNet's accuracy evaluation only (run_acc_eval.py)")
        return []
    # run_acc_eval.py passes --img_size image_size to evaluate_imagenet_robustbench.py (bicubic
    # Resize floor(size / 0.875), CenterCrop size): the test-set metrics run at this size
    return [f"data.image_size={size}"]


def _attack_overrides(raw: Dict[str, Any], path: str, notices: List[str]) -> List[str]:
    # run_acc_eval.py passes pgd_epsilon as --eps of both its CIFAR and ImageNet evaluations
    overrides = [f"indist_attack_clf.eps={_number(raw, 'pgd_epsilon', path, float)}"]
    if "threat_model" in raw:
        threat = _choice(raw, "threat_model", THREAT_MODELS, path)
        if raw["dataset"] == "imagenet":  # run_acc_eval.py: config.get("threat_model", "L2")
            overrides.append(f"indist_attack_clf.norm={threat}")
        elif threat != "L2":
            notices.append(f"{path}: threat_model {threat} is not used: the original's CIFAR "
                           "evaluation is always L2 (run_acc_eval.py --distance_type L2)")
    return overrides


def _template(raw: Dict[str, Any], path: str, notices: List[str]) -> Optional[FidTemplate]:
    name = str(raw["fid_eval_config"]).removeprefix("./")
    template = FID_TEMPLATES.get(name)
    if template is None:
        notices.append(f"{path}: fid_eval_config '{name}' is not one of the original's FID "
                       "templates rebm knows; the protocol table's sample settings are used")
    elif template.dataset != raw["dataset"]:
        notices.append(f"{path}: fid_eval_config '{name}' is a {template.dataset} template "
                       f"for a {raw['dataset']} model; the protocol table's sample settings "
                       "are used")
        return None
    return template


def _seed(stem: str, raw: Dict[str, Any]) -> Optional[int]:
    """The training seed: the file name's -seed<N>, else rand_seed=<N> of its train_cmd."""
    found = _SEED.search(stem) or _TRAIN_SEED.search(str(raw.get("train_cmd") or ""))
    return int(found.group(1)) if found else None


def original_row(path: str) -> Tuple[RowSpec, str, Optional[FidTemplate], List[str]]:
    """(row, dataset, FID template or None, notices) of the original model config at `path`."""
    raw = read_mapping(path, "original model config")
    notices: List[str] = []
    missing = [k for k in REQUIRED_KEYS if k not in raw]
    if missing:
        raise TableError(f"{path}: '{missing[0]}' is missing (an original model config has "
                         f"{', '.join(REQUIRED_KEYS)})")
    unknown = [k for k in raw if k not in (*REQUIRED_KEYS, *OPTIONAL_KEYS, *INFORMATIONAL_KEYS)]
    notices += [f"{path}: key '{k}' is not a key of the original's model configs; ignored"
                for k in unknown]
    method = _choice(raw, "method", tuple(METHODS), path)
    dataset = _choice(raw, "dataset", tuple(PROTOCOL_TABLES), path)
    stem = Path(path).stem
    if not re.fullmatch(r"[\w.+-]+", stem):
        raise TableError(f"{path}: the file name may hold only letters, digits and _ . + - (it "
                         "names the row and its cache file)")
    template = _template(raw, path, notices)
    # run_fid_eval.py passes image_log.num_steps=fid_num_steps (line 152) and
    # image_log.ood_data_dir=ood_data_dir (line 159), the seed images of the samples
    overrides = [f"image_log.num_steps={_number(raw, 'fid_num_steps', path, int)}"]
    if raw.get("ood_data_dir"):
        overrides.append(f"image_log.seed_images={raw['ood_data_dir']}")
    overrides += _model_overrides(raw, template, path, notices)
    overrides += _image_size_overrides(raw, path, notices)
    overrides += _attack_overrides(raw, path, notices)
    label, baseline = METHODS[method]
    row = RowSpec(name=stem, group=_SEED.sub("", stem), seed=_seed(stem, raw),
                  config=str(REPO / _row_config(dataset, str(raw["model_type"]), path)),
                  # paths relative to the original's project folder, some with a leading ./
                  checkpoint=os.path.normpath(str(raw["checkpoint"])),
                  overrides=tuple(overrides), baseline=baseline,
                  source=f"original model config {path} ({label}, {raw['model_type']})",
                  notes=_text(raw.get("notes")))
    return row, dataset, template, notices


def protocol_table(dataset: str, protocol: Optional[str]) -> TableSpec:
    """The table whose protocol a dataset's rows take: `protocol` or the shipped one."""
    path = protocol or str(REPO / PROTOCOL_TABLES[dataset])
    if protocol is None and not os.path.isfile(path):
        raise TableError(f"the {dataset} protocol table {path} is not there; name a table "
                         "with --protocol TABLE")
    return load_table(path)


def _sample_sizes(protocol: TableSpec, templates: Sequence[Optional[FidTemplate]]
                  ) -> Dict[str, Tuple[str, ...]]:
    """metric_overrides that put the sample metrics at their FID template's size:
    run_fid_eval.py passes no image size, so every sample of an ImageNet model is 256 px (the
    templates' data.image_size), a 224 px model's included."""
    sizes = {t.image_size for t in templates if t is not None and t.image_size}
    overrides = {m: tuple(protocol.metric_overrides.get(m, ())) for m in protocol.metrics}
    if len(sizes) == 1:
        size = sizes.pop()
        for cls in metric_classes(protocol.metrics):
            if cls.source == SAMPLES:
                overrides[cls.name] += (f"data.image_size={size}",)
    return {m: o for m, o in overrides.items() if o}


def _table(dataset: str, rows: List[Tuple[RowSpec, Optional[FidTemplate]]], path: str,
           name: str, protocol: Optional[str], notices: List[str]) -> TableSpec:
    base = protocol_table(dataset, protocol)
    title = (f"{rows[0][0].name} (original model config; protocol: {base.title})"
             if len(rows) == 1 else f"{base.title}: original model configs of {path}")
    return TableSpec(path=path, title=title, metrics=base.metrics,
                     rows=tuple(r for r, _ in rows), batch_size=base.batch_size,
                     overrides=base.overrides,
                     metric_overrides=_sample_sizes(base, [t for _, t in rows]),
                     columns=base.columns, name=name, notices=tuple(notices))


def original_tables(path: str, protocol: Optional[str] = None) -> List[TableSpec]:
    """The tables of an original model config file (one row) or of a folder of them (one
    table per dataset, rows sorted by file name)."""
    if not os.path.isdir(path):
        row, dataset, template, notices = original_row(path)
        return [_table(dataset, [(row, template)], path, Path(path).stem, protocol, notices)]
    files = sorted(f for f in os.listdir(path) if f.endswith((".yaml", ".yml")))
    if not files:
        raise TableError(f"folder {path} holds no .yaml files (original model configs)")
    by_dataset: Dict[str, List[Tuple[RowSpec, Optional[FidTemplate]]]] = {}
    notices: Dict[str, List[str]] = {}
    for file in files:
        row, dataset, template, found = original_row(os.path.join(path, file))
        by_dataset.setdefault(dataset, []).append((row, template))
        notices.setdefault(dataset, []).extend(found)
    folder = Path(path).name or "model_configs"
    return [_table(dataset, rows, path, f"{folder}-{dataset}", protocol, notices[dataset])
            for dataset, rows in sorted(by_dataset.items())]
