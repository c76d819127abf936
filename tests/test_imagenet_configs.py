"""experiments/imagenet/*: the DAT ImageNet configs in the original schema pass `--check` on 8
devices, which prints the memory plan and, with `gpu_mem_gib=80`, the largest micro-batch that
fits. They need the ImageNet data half (data.indist_dataset: ImageNet, OpenImageO, the ImageNet
augmentations); skipped until it is there.

The plan depends on the model, the image size and the batch: one recipe of each (model, size)
runs it (the twins differ only in the curriculum, which tests/test_recipes.py checks), so the
memory plans built here are those of the four models."""

import glob
import os

import pytest

from rebm.config import load_config
from rebm.config.datasets import INDIST_DATASETS
from rebm.training import train as train_entry
from tests.helpers import REPO

CONFIGS = sorted(glob.glob(str(REPO / "experiments" / "imagenet" / "*.yaml")))


def _one_per_model_and_size(paths):
    chosen = {}
    for path in paths:
        cfg = load_config(path)
        chosen.setdefault((cfg.model.model_type, cfg.data.image_size), path)
    return sorted(chosen.values())


PLANNED = _one_per_model_and_size(CONFIGS)


@pytest.mark.skipif("ImageNet" not in INDIST_DATASETS,
                    reason="data.indist_dataset: ImageNet is not available yet")
@pytest.mark.parametrize("path", PLANNED, ids=os.path.basename)
def test_imagenet_config_passes_check_with_memory_plan(path, capsys, monkeypatch):
    """In process (the real entry function), as test_config.py does for the other configs."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    try:
        code = train_entry.main([path, "--check", "gpu_mem_gib=80"])
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    assert code in (0, None), err[-3000:]
    for key in ("use_ddp:", "ddp_backend:", "sweep_radius:", "openimages_max_samples:",
                "norm: L2", "indist_dataset: ImageNet"):
        assert key in out, key
    assert "# batch plan at world size 8: 64 per device" in out
    assert "# memory plan per device (world size 8, micro-batch 64 x 3 streams" in out
    assert "that fits 80 GiB" in out and "total:" in out


def test_configs_are_there():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"dat_resnet50_224px.yaml", "imagenet-dat-ResNet50ImageNet-T15-256x256.yaml",
            "imagenet-dat-ResNet50ImageNet-T30-256x256.yaml",
            "imagenet-dat-WideResNet50x4ImageNet-T30-256x256.yaml",
            "imagenet-dat-WideResNet50x4ImageNet-T65-256x256.yaml",
            "imagenet-dat-ConvNeXtLarge-convst-256x256-stepsize3.yaml"} == names
    assert len(PLANNED) == 4  # ResNet-50 at 224 and 256 px, WideResNet-50-4, ConvNeXt-L
