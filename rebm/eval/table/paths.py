"""Where a table row reads its relative data paths from: one rule, for the run and for --check.

A relative path of a file or folder that a row's metrics read (`Metric.files`: FID statistics,
seed images, reference batches, per-class statistics, dataset roots, ...) is looked up under the
`--checkpoints` folder first, then in the current directory; the first place that has it is
used. `--checkpoints` is the original's project folder when its published files are used: its
README has the "model checkpoints and FID data" placed under the project folder (README.md:16
at fb2ffc7) and its configs read `./data/...` from there, so such a folder works as it is. A
path found in neither place stays as written (relative to the current directory), and --check
says where it looked. Absolute and `~` paths are read as they are; the checkpoint itself is
always relative to `--checkpoints`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from typing import Any, Dict, List, Sequence, Tuple

from rebm.config import replace
from rebm.config.views import EvaluationSection


def search_folders(root: str) -> Tuple[str, ...]:
    """The folders a relative data path is looked up in, in order (once when they are one)."""
    here = os.getcwd()
    same = os.path.realpath(root) == os.path.realpath(here)
    return (here,) if same else (root, here)


def find_data_path(path: str, root: str) -> Tuple[str, Tuple[str, ...]]:
    """(the path to read, the folders looked in) of a data path under the module's rule;
    an absolute path is itself, looked up nowhere."""
    if os.path.isabs(os.path.expanduser(path)):
        return path, ()
    folders = search_folders(root)
    if len(folders) > 1:
        rooted = os.path.normpath(os.path.join(root, path))
        if os.path.exists(rooted):
            return rooted, folders
    return path, folders


def rooted_config(cfg, classes: Sequence[Any], root: str):
    """`cfg` with each relative data path of the metrics' files (`Metric.files` of `classes`)
    that exists under `root` read from there: a frozen copy, or `cfg` when nothing moves."""
    moves: Dict[str, Dict[str, str]] = {}  # config key -> {path as written: path under root}
    for cls in classes:
        for label, path in cls.files(cfg.evaluation).items():
            if path is None:
                continue
            chosen, _ = find_data_path(str(path), root)
            if chosen != path:
                # 'eval.counterfactual_fid_stats[3]', 'eval.ood_datasets[name]': their key
                moves.setdefault(label.partition("[")[0], {})[str(path)] = chosen
    for key, moved in moves.items():
        value = _value(cfg, key.split("."))
        new = _moved(value, moved, root)
        if new is not value:
            cfg = _with_value(cfg, key.split("."), new, top=True)
    return cfg


def _value(obj: Any, parts: List[str]) -> Any:
    """The value at a dotted config key; None for a dict entry left at its default."""
    for part in parts:
        obj = obj.get(part) if isinstance(obj, dict) else getattr(obj, part, None)
    return obj


def _moved(value: Any, moved: Dict[str, str], root: str) -> Any:
    """A config value with its moved paths replaced; `value` itself when it holds none of them
    (a value the files were derived from, e.g. eval.image_ids 'robustbench')."""
    if value is None and len(moved) == 1:  # a default entry (eval.ood_roots.<set>)
        return next(iter(moved.values()))
    if isinstance(value, str):
        if value in moved:
            return moved[value]
        if "{" in value:  # a per-class template, whose files were found under root
            return os.path.normpath(os.path.join(root, value))
        return value
    if isinstance(value, (list, tuple)) and any(v in moved for v in value):
        return type(value)(moved.get(v, v) for v in value)
    return value


def _with_value(obj: Any, parts: List[str], value: Any, top: bool = False) -> Any:
    """A copy of `obj` (the config, a section or a dict) with `value` at the dotted key
    `parts`; the config's copy is frozen and keeps the record of the keys the user set."""
    head, rest = parts[0], parts[1:]
    current = obj.get(head) if isinstance(obj, dict) else getattr(obj, head)
    new = _with_value(current, rest, value) if rest else value
    if isinstance(obj, dict):
        return {**obj, head: new}
    return (replace if top else dataclasses.replace)(obj, **{head: new})


def missing_data_paths(evaluation: EvaluationSection, classes: Sequence[Any], root: str
                       ) -> List[Tuple[str, str, Tuple[str, ...]]]:
    """(key, path, folders looked in) of each relative data path of the metrics' files found
    in none of the folders (after `rooted_config`, such a path is still as written)."""
    missing = []
    for cls in classes:
        for label, path in cls.files(evaluation).items():
            if path is None or os.path.exists(str(path)):
                continue
            _, folders = find_data_path(str(path), root)
            if folders:
                missing.append((label, str(path), folders))
    return list(dict.fromkeys(missing))


def rule_line(root: str) -> str:
    """The rule, with this command's folders (the first line of --check)."""
    folders = search_folders(root)
    if len(folders) == 1:
        return (f"relative data paths: looked up in {folders[0]} (--checkpoints, the current "
                "directory)")
    return (f"relative data paths: looked up in {folders[0]} (--checkpoints) first, then in "
            f"{folders[1]} (the current directory)")


def looked_in(folders: Sequence[str]) -> str:
    """'looked in DIR, then CWD' of `search_folders`."""
    return "looked in " + ", then ".join(folders)


def config_value(evaluation: EvaluationSection, label: str) -> Any:
    """The config value behind a `Metric.files` label ('eval.counterfactual_fid_stats[3]' ->
    the template it was formatted from), read from the evaluation section; None for a label
    that is no config key."""
    return _value(evaluation, label.partition("[")[0].split("."))


def missing_target(path: str, root: str) -> Tuple[str, Tuple[str, ...]]:
    """(the absolute path a missing file goes to, the folders it was looked in). A relative
    path goes under the rule's first folder, --checkpoints: the run looks there first, and the
    original's README puts its data under the project folder that --checkpoints stands for."""
    _, folders = find_data_path(path, root)
    if not folders:
        return os.path.abspath(os.path.expanduser(path)), ()
    return os.path.abspath(os.path.join(folders[0], path)), folders


# Where each file of the original's layout comes from, for --check's list of missing files:
# (fnmatch patterns of the path as the configs write it, relative to the project folder, or of
# an absolute path; where to get it). The first match wins. The same sources as docs/data.md
# ("Where the original puts each") and docs/evaluation.md; at xuwangyin/DAT fb2ffc7.
_DROPBOX = ("https://www.dropbox.com/scl/fo/81n3lxw5dvhds56guuegh/AN3sYMNamKQnCkkFXC3CKcg"
            "?rlkey=ih9m3rasrmuzeyxwe7qjcpue9&st=b3a1r2nz&dl=0")
DATA_SOURCES: Tuple[Tuple[Tuple[str, ...], str], ...] = (
    (("checkpoints/*", "wandb/*", "data/fid_stats/fid_stats_*_train.npz",
      "data/fid_stats/imagenet_train_stats.npz", "data/cifar_fid_imgs_50K.pt"),
     "the original's Dropbox folder of model checkpoints and FID data (its README.md:16), "
     f"its folders placed under --checkpoints: {_DROPBOX}"),
    (("data/fid_stats/*_class*.npz",),
     "rebm itself (the original did not distribute them; it computed them from each class's "
     "images on every run): python -m rebm.eval.counterfactuals CONFIG --class-stats TEMPLATE "
     "(the config's eval.counterfactual_fid_stats)"),
    (("data/ImageNet", "data/ImageNet/*"),
     "image-net.org, ILSVRC 2012 (registration; the original's README.md:14); the layout "
     "torchvision builds: docs/data.md, ImageNet"),
    (("data/OpenImage-O-large/*",),
     "the original's data/OpenImage-O-large/README.md (README.md:13): its scripts download "
     "train/ and val/ by Open Images file id, make_openimages_50K_val_fideval.py writes "
     "OpenImagesO_fid_eval/ from val/ (rename it fid_eval/; docs/data.md, OpenImage-O)"),
    (("data/CIFAR10", "data/CIFAR100"),
     "torchvision: .venv/bin/python -c \"import torchvision; "
     "torchvision.datasets.CIFAR10('DIR', download=True)\" (CIFAR100 alike; the original "
     "keeps them in ./datasets: docs/data.md)"),
    (("data/tiny_images.bin",),
     "archive.org, the copy the original's README.md:15 names (80M TinyImages was withdrawn by "
     "its authors in 2020; rebm does not download it; docs/data.md): "
     "http://www.archive.org/download/80-million-tiny-images-2-of-2/tiny_images.bin"),
    (("data/TinyImagesExclusionIdcs", "data/TinyImagesExclusionIdcs/*"),
     "the original's repository, its folder InNOutRobustness/TinyImagesExclusionIdcs "
     "(https://github.com/xuwangyin/DAT; docs/data.md, 80M TinyImages)"),
    (("*VIRTUAL_imagenet256_labeled.npz",),
     "OpenAI's guided-diffusion reference batch (the original's README.md:75): https://"
     "openaipublic.blob.core.windows.net/diffusion/jul-2021/ref_batches/imagenet/256/"
     "VIRTUAL_imagenet256_labeled.npz"),
    (("*/pt_inception-2015-12-05-6726825d.pth",),
     "pytorch-fid's release (docs/evaluation.md, Inception weights): https://github.com/"
     "mseitzer/pytorch-fid/releases/download/fid_weights/pt_inception-2015-12-05-6726825d.pth"),
)
NO_SOURCE = "a place rebm does not know (docs/data.md says where each dataset comes from)"


def data_source(path: str) -> str:
    """Where the file or folder `path` (as a config writes it) comes from: DATA_SOURCES."""
    key = os.path.normpath(os.path.expanduser(path))  # './data/x' -> 'data/x'
    for patterns, source in DATA_SOURCES:
        if any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns):
            return source
    return NO_SOURCE
