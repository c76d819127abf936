"""Public robust ImageNet checkpoint layouts, written here in their real on-disk form with tiny
models: the `robustness` library's, Singh et al.'s ConvNeXt-ConvStem files (plain and with their
normalising Sequential), timm's plain state dicts and timm's training checkpoints."""

import argparse

import pytest
import torch
from timm.models.convnext import ConvNeXt
from timm.models.resnet import Bottleneck, ResNet

from rebm.checkpoint.layouts import NormaliserMismatch
from rebm.checkpoint.weights import CheckpointError, load_checkpoint
from rebm.models import build_model
from rebm.models.stats import CIFAR10_MEAN, CIFAR10_STD, IMAGENET_MEAN, IMAGENET_STD
from rebm.standin.writers import write_robustness_checkpoint
from tests.timm_reference import timm_arguments

pytestmark = pytest.mark.numbers

X = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))


def _seeded(model_type, seed, **options):
    torch.manual_seed(seed)
    model = build_model(model_type, 10, **options)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return model.eval()


def _stats(mean, std):
    return torch.tensor(mean).view(3, 1, 1), torch.tensor(std).view(3, 1, 1)


def test_robustness_layout_loads_the_network_and_checks_the_normaliser(tmp_path):
    ref = _seeded("TinyResNetImageNet", 0)
    path = write_robustness_checkpoint(tmp_path / "resnet50_l2_eps3.ckpt", ref)
    model = _seeded("TinyResNetImageNet", 1)
    report = load_checkpoint(model, path)
    assert "robustness (model.*)" in report.layout and report.layout.startswith("['model']")
    with torch.no_grad():
        assert torch.equal(model(X), ref(X))

    raw = _seeded("TinyResNetImageNet", 1, normalize_input=False)
    with pytest.raises(NormaliserMismatch, match="set model.normalize_input=true") as err:
        load_checkpoint(raw, path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)

    cifar = write_robustness_checkpoint(tmp_path / "cifar_stats.ckpt", ref, CIFAR10_MEAN, CIFAR10_STD)
    with pytest.raises(NormaliserMismatch, match="normalises its inputs with mean"):
        load_checkpoint(_seeded("TinyResNetImageNet", 1), cifar)


def test_convstem_files_plain_and_with_normalising_sequential(tmp_path):
    ref = _seeded("convnext_test", 0, use_convstem=True, normalize_input=False)
    # add_normalization off (e.g. ConvNeXt-L-CvSt): the network's own names, saved under DDP
    plain = tmp_path / "convnext_cvst_robust.pt"
    torch.save({"module." + k: v for k, v in ref.state_dict().items()}, plain)
    model = _seeded("convnext_test", 1, use_convstem=True, normalize_input=False)
    assert load_checkpoint(model, plain).layout == "module."
    with torch.no_grad():
        assert torch.equal(model(X), ref(X))

    # add_normalization on: Sequential(normalize=ImageNormalizer, model=net) under DDP
    normed_ref = _seeded("convnext_test", 0, use_convstem=True)
    mean, std = _stats(IMAGENET_MEAN, IMAGENET_STD)
    sd = {"module.normalize.mean": mean.view(1, 3, 1, 1), "module.normalize.std":
          std.view(1, 3, 1, 1)}
    sd.update({"module.model." + k: v for k, v in normed_ref.state_dict().items()})
    seq = tmp_path / "convnext_cvst_normalized.pt"
    torch.save(sd, seq)
    model = _seeded("convnext_test", 1, use_convstem=True)
    assert "normalize+model (model.*)" in load_checkpoint(model, seq).layout
    with torch.no_grad():
        assert torch.equal(model(X), normed_ref(X))

    # a ConvStem file into a patch-stem model: a short diff naming the stem keys
    with pytest.raises(CheckpointError, match="stem.stem.0"):
        load_checkpoint(_seeded("convnext_test", 1, normalize_input=False), plain)


def test_timm_plain_state_dict_and_training_checkpoint(tmp_path):
    torch.manual_seed(0)
    timm_resnet = ResNet(block=Bottleneck, num_classes=10,
                         **timm_arguments("TinyResNetImageNet")).eval()
    plain = tmp_path / "pytorch_model.bin"
    torch.save(timm_resnet.state_dict(), plain)
    model = _seeded("TinyResNetImageNet", 1)
    assert load_checkpoint(model, plain).layout == "plain"
    mean, std = _stats(IMAGENET_MEAN, IMAGENET_STD)
    with torch.no_grad():
        assert (model(X) - timm_resnet((X - mean) / std)).abs().max() <= 1e-6

    # timm's train.py: {'epoch', 'arch', 'state_dict', 'state_dict_ema', 'args', ...}
    torch.manual_seed(1)
    timm_ema = ConvNeXt(num_classes=10, **timm_arguments("convnext_test")).eval()
    torch.manual_seed(2)
    timm_online = ConvNeXt(num_classes=10, **timm_arguments("convnext_test"))
    ckpt = tmp_path / "model_best.pth.tar"
    torch.save({"epoch": 3, "arch": "convnext_test", "state_dict": timm_online.state_dict(),
                "state_dict_ema": timm_ema.state_dict(), "args": argparse.Namespace(lr=1e-3),
                "version": 2}, ckpt)
    model = _seeded("convnext_test", 3, normalize_input=False)
    assert load_checkpoint(model, ckpt, prefer_ema=True).layout == "['state_dict_ema']"
    with torch.no_grad():
        assert torch.equal(model(X), timm_ema(X))
    assert load_checkpoint(model, ckpt).layout == "['state_dict']"


class Schedule:
    """A harmless object of a class outside rebm's allow-list (a pickled scheduler, say)."""

    def __init__(self):
        self.epoch = 90


def test_a_layout_with_foreign_objects_is_not_unpickled(tmp_path):
    ref = _seeded("TinyResNetImageNet", 0)
    path = tmp_path / "robustness_with_object.ckpt"
    torch.save({"model": {"module.model." + k: v for k, v in ref.state_dict().items()},
                "schedule": Schedule()}, path)
    with pytest.raises(CheckpointError, match="model.trust_checkpoint=true"):
        load_checkpoint(_seeded("TinyResNetImageNet", 1), path)


def test_a_wrapper_network_without_its_normaliser(tmp_path):
    """`module.model.*` alone (a normalising wrapper saved without its statistics) loads too."""
    ref = _seeded("TinyResNetImageNet", 0)
    path = tmp_path / "wrapped.pt"
    torch.save({"module.model." + k: v for k, v in ref.state_dict().items()}, path)
    model = _seeded("TinyResNetImageNet", 1)
    assert load_checkpoint(model, path).layout == "module. > model."
    with torch.no_grad():
        assert torch.equal(model(X), ref(X))
