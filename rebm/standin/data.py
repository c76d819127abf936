"""The stand-in files of a recipe, written where its config reads them (paths relative to the
stand-in folder, as the recipe's are relative to the project folder), in the real on-disk
formats (rebm.standin.writers). A file that is there already is kept: recipes that read the same
data share it, and nothing written before is replaced."""

from __future__ import annotations

import os
from typing import Callable, List

from rebm.config import TrainConfig
from rebm.config.schema import SEED_NOISES, DataConfig, ImageLogConfig
from rebm.standin import writers
from rebm.standin.recipes import TINYIMAGES, Stage

CIFAR_TRAIN, CIFAR_TEST = 96, 41  # three global batches of 32; an odd test set
TINYIMAGES_RECORDS = 200
SEEDS = 20  # seed images of the samples (image_log.num_samples of the stand-in runs)
IMAGENET = dict(num_classes=3, n_train=6, n_val=3, height=72, width=80)  # 18 train, 9 val
OPENIMAGES = 12  # >= openimages_max_samples of the stand-in runs


def _once(path: str, write: Callable[[], object], written: List[str]) -> None:
    if not os.path.exists(path):
        write()
        written.append(path)


def tinyimages_file(data: DataConfig) -> str:
    """Where the TinyImages loader reads tiny_images.bin (data.outdist_std_dir: it or its
    folder)."""
    path = data.outdist_std_dir
    return path if path.endswith(".bin") else os.path.join(path, "tiny_images.bin")


def write_indist(data: DataConfig, written: List[str]) -> None:
    root = data.indist_ds_dir
    if data.indist_dataset == "ImageNet":
        _once(os.path.join(root, "meta.bin"), lambda: writers.write_fake_imagenet(
            root, **IMAGENET), written)
    elif data.num_classes == 100:
        _once(os.path.join(root, "cifar-100-python"), lambda: writers.write_fake_cifar100(
            root, n_train=CIFAR_TRAIN, n_test=CIFAR_TEST), written)
    else:
        _once(os.path.join(root, "cifar-10-batches-py"), lambda: writers.write_fake_cifar10(
            root, n_train=CIFAR_TRAIN, n_test=CIFAR_TEST), written)


def write_outdist(data: DataConfig, written: List[str]) -> None:
    if data.outdist_dataset in TINYIMAGES:
        path = tinyimages_file(data)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        _once(path, lambda: writers.write_tiny_images(path, TINYIMAGES_RECORDS), written)
        if data.tinyimages_exclusion_dir:
            _once(data.tinyimages_exclusion_dir, lambda: writers.write_tinyimages_exclusion_lists(
                data.tinyimages_exclusion_dir, TINYIMAGES_RECORDS), written)
    elif data.outdist_dataset == "OpenImageO":
        _once(data.outdist_std_dir, lambda: writers.write_fake_openimage_o(
            data.outdist_std_dir, n=OPENIMAGES, height=72, width=80), written)


def write_seed_images(image_log: ImageLogConfig, written: List[str]) -> None:
    seeds = image_log.seed_images
    if seeds in SEED_NOISES:
        return
    if os.path.splitext(seeds)[1] in (".pt", ".npy", ".npz"):
        os.makedirs(os.path.dirname(seeds) or ".", exist_ok=True)
        _once(seeds, lambda: writers.write_tensor_file(seeds, n=SEEDS, layout="NCHW"), written)
    else:  # a folder of images (ImageNet's OpenImage-O fid_eval)
        _once(seeds, lambda: writers.write_fake_openimage_o(seeds, n=SEEDS, height=72, width=80,
                                                            seed=2), written)


def write_starting_checkpoint(cfg: TrainConfig, written: List[str]) -> None:
    """A public robust checkpoint of the small model in the layout its family's file has: the
    `robustness` library's (ResNets) or Singh et al.'s ConvStem ConvNeXt ('module.*')."""
    path = cfg.model.ckpt_path

    def write() -> None:
        import torch

        from rebm.models import build_model

        torch.manual_seed(0)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        classes = cfg.data.num_classes
        if cfg.model.model_type.startswith("convnext"):
            model = build_model(cfg.model.model_type, classes, use_convstem=cfg.model.use_convstem,
                                normalize_input=cfg.model.normalize_input)
            torch.save({"module." + k: v for k, v in model.state_dict().items()}, path)
        else:
            writers.write_robustness_checkpoint(path, build_model(cfg.model.model_type,
                                                                  classes).eval())
    _once(path, write, written)


def write_stage_data(stage: Stage, family: str) -> List[str]:
    """Write what `stage` reads and is not there yet; the paths written."""
    written: List[str] = []
    cfg = stage.cfg
    write_indist(cfg.data, written)
    if stage.number == 2:  # stage 1 reads the classifier stream only
        write_outdist(cfg.data, written)
        write_seed_images(cfg.image_log, written)
        if family == "imagenet" and cfg.model.ckpt_path:
            write_starting_checkpoint(cfg, written)
    return written
