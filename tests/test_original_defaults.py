"""The original's config defaults that change a number are rebm's too (docs/configs.md, "The
original's defaults"): a config of the original that leaves them unset means the same here."""

from __future__ import annotations

import pytest

from rebm.config.loading import load_config
from rebm.config.schema import TrainConfig
from tests.helpers import REPO

CONVNEXT = REPO / "experiments" / "imagenet" / \
    "imagenet-dat-ConvNeXtLarge-convst-256x256-stepsize3.yaml"


def _without(tmp_path, source, *lines: str):
    text = source.read_text()
    for line in lines:
        assert line in text, line
        text = text.replace(line, "")
    path = tmp_path / source.name
    path.write_text(text)
    return str(path)


def test_convnext_uses_the_convstem_unless_the_config_says_otherwise(tmp_path):
    """The original's ConvNextConfig defaults use_convstem to true."""
    path = _without(tmp_path, CONVNEXT, "  use_convstem: true\n")
    assert load_config(path, []).model.use_convstem is True
    assert load_config(path, ["model.use_convstem=false"]).model.use_convstem is False
    assert load_config(path, ["model.model_type=ResNet50ImageNet",
                              "model.normalize_input=true"]).model.use_convstem is False


@pytest.mark.parametrize("dataset,classes", [("cifar10", 10), ("cifar100-conditional", 100),
                                             ("ImageNet", 1000)])
def test_num_classes_unset_is_the_datasets(tmp_path, dataset, classes):
    path = tmp_path / "c.yaml"
    path.write_text(f"data:\n  indist_dataset: {dataset}\n")
    assert load_config(str(path), []).data.num_classes == classes
    assert load_config(str(path), ["data.num_classes=7"]).data.num_classes == 7


def test_training_defaults_are_the_originals():
    cfg = TrainConfig()
    assert cfg.ema.use_ema is False  # the original's TrainConfig.use_ema
    assert cfg.image_log.sweep_radius == 3  # the original's ImageLogConfig.sweep_radius
    assert cfg.method.logsumexp is True and cfg.method.logsumexp_sampling is False
