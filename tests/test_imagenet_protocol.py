"""The ImageNet side of the paper's protocol: the 256 px evaluation transform, the sizes every
ImageNet table row is evaluated at (sample metrics always at 256 px), and the original's
defaults for an ImageNet config that does not state its size.

Tiny ImageNet in torchvision's layout, written by the test (rebm/standin/writers.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from torchvision import transforms

from rebm.config import TrainConfig
from rebm.config.loading import load_config
from rebm.data.pipeline import load_indist
from rebm.eval.metric import SAMPLES
from rebm.eval.registry import metric_classes
from rebm.eval.table.spec import load_table, row_sections
from rebm.standin.writers import write_fake_imagenet
from tests.helpers import REPO

pytestmark = pytest.mark.numbers

SAMPLE_METRICS = {c.name for c in metric_classes(["fid", "inception_score", "precision_recall"])
                  if c.source == SAMPLES}


@pytest.fixture(scope="module")
def imagenet_root(tmp_path_factory):
    return write_fake_imagenet(str(tmp_path_factory.mktemp("imagenet") / "ImageNet"),
                               num_classes=3, n_train=2, n_val=2, height=300, width=340)


def _cfg(root: str, size: int) -> TrainConfig:
    cfg = TrainConfig()
    cfg.data.indist_dataset = "ImageNet"
    cfg.data.indist_ds_dir = root
    cfg.data.num_classes = 3
    cfg.data.image_size = size
    cfg.data.num_workers = 0
    return cfg


@pytest.mark.parametrize("size,resize", [(256, 292), (224, 256)])
def test_eval_transform_is_the_originals_resize_and_center_crop(imagenet_root, size, resize):
    """The test split at `size` is torchvision's Resize(floor(size / 0.875), bicubic) +
    CenterCrop(size) of the same files, as the original's evaluate_imagenet_robustbench.py
    (292 / 256 at 256 px, 256 / 224 at 224 px)."""
    assert int(np.floor(size / 0.875)) == resize
    reference = transforms.Compose([
        transforms.Resize(resize, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(size), transforms.ToTensor()])
    tv_val = torchvision.datasets.ImageNet(imagenet_root, split="val")
    test_set = load_indist(_cfg(imagenet_root, size).data, "test")
    assert len(test_set) == len(tv_val) == 6
    for i in range(len(tv_val)):
        x, y = test_set[i]
        path, label = tv_val.samples[i]
        with Image.open(path) as img:
            expected = reference(img.convert("RGB"))
        assert y == label and x.shape == (3, size, size)
        assert torch.equal(x, expected), f"image {i} differs from torchvision's transform"


def _row_configs(table: str):
    """(spec, {row: {metric: config}}) of a shipped table, loaded as the runner loads them."""
    spec = load_table(str(REPO / "experiments" / "paper" / table))
    return spec, row_sections(spec, "checkpoints")


def _row_sizes(table: str):
    """{row: {metric: data.image_size}} of a shipped table."""
    spec, configs = _row_configs(table)
    return spec, {row: {metric: cfg.data.image_size for metric, cfg in by_metric.items()}
                  for row, by_metric in configs.items()}


def test_the_256px_table_is_the_readmes_eight_models_at_256px():
    spec, configs = _row_configs("imagenet256.yaml")
    assert len(spec.rows) == 8
    steps = [configs[r.name]["fid"].image_log.num_steps for r in spec.rows]
    assert steps == [13, 12, 0, 14, 14, 17, 19, 24]
    assert all(cfg.data.image_size == 256 and cfg.schedule.rand_seed == 0
               for row in configs.values() for cfg in row.values())
    convnext = [configs[r.name]["accuracy"] for r in spec.rows if "convnext" in r.name]
    assert convnext and all(c.model.use_convstem and not c.model.normalize_input
                            for c in convnext)


def test_every_imagenet_rows_sample_metrics_run_at_256px():
    """The original's FID templates set data.image_size 256 for every model, so the 224 px
    models' samples are 256 px too; their accuracy stays at 224 px."""
    _, sizes = _row_sizes("imagenet.yaml")
    for row, by_metric in sizes.items():
        for metric, size in by_metric.items():
            assert size == (256 if metric in SAMPLE_METRICS else 224), (row, metric)


def test_an_imagenet_config_without_a_size_is_256px(tmp_path):
    """The original's data.image_size default is 256 and none of its ImageNet training configs
    sets it: such a config trains and evaluates at 256 px in rebm too."""
    text = (REPO / "experiments" / "imagenet" / "dat_resnet50_224px.yaml").read_text()
    assert "  image_size: 224\n" in text
    path = tmp_path / "no_size.yaml"
    path.write_text(text.replace("  image_size: 224\n", ""))
    assert load_config(str(path), []).data.image_size == 256
    assert load_config(str(path), ["data.image_size=224"]).data.image_size == 224


def test_shipped_imagenet_configs_state_their_size():
    folder = REPO / "experiments" / "imagenet"
    for name in sorted(os.listdir(folder)):
        assert "\n  image_size: " in (folder / name).read_text(), name
