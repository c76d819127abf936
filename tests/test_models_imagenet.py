"""The ImageNet models (rebm.models.timm_families): every registered type builds, has timm's parameter
names and shapes, and gives timm's own logits for the same weights; ConvStem, input
normalisation, frozen BatchNorm, forward(x, y), and the config path (model_from_config)."""

import dataclasses
import math

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.models.convnext import ConvNeXt
from timm.models.resnet import Bottleneck, ResNet

from rebm.config import TrainConfig
from rebm.models import build_model, model_from_config, model_names
from rebm.models.stats import IMAGENET_MEAN, IMAGENET_STD
from rebm.models.timm_families import CONVNEXTS, RESNETS
from tests.timm_reference import timm_arguments, timm_name

pytestmark = pytest.mark.numbers

IMAGENET_TYPES = list(RESNETS) + list(CONVNEXTS)
NUM_CLASSES = 7


def timm_reference(model_type: str, **kwargs):
    """timm's own network for `model_type`: its registered model where timm has one, else its
    ResNet / ConvNeXt class with the same arguments."""
    name = timm_name(model_type)
    if name is not None:
        return timm.create_model(name, num_classes=NUM_CLASSES, **kwargs)
    if model_type in RESNETS:
        return ResNet(block=Bottleneck, num_classes=NUM_CLASSES, **timm_arguments(model_type),
                      **kwargs)
    return ConvNeXt(num_classes=NUM_CLASSES, **timm_arguments(model_type), **kwargs)


def materialised(model_type: str, **options):
    """The model with seeded random weights, built on the meta device first: random-filling is
    much cheaper than timm's initialisers for WideResNet-50-4 / ConvNeXt-L (hundreds of millions
    of parameters). Fan-in-scaled weights keep the logits of deep random nets finite."""
    with torch.device("meta"):
        model = build_model(model_type, NUM_CLASSES, **options)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(1 << 20, generator=gen)  # tiled over the weights: drawing 200M is slow

    def fill(p, start):
        n = p.numel()
        p.view(-1).copy_(noise.roll(start % noise.numel()).repeat(n // noise.numel() + 1)[:n])

    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if p.dim() > 1:
                fill(p, 7919 * i)
                p.mul_(1 / math.sqrt(p[0].numel()))
            elif name.endswith("gamma"):
                p.fill_(0.1)
            else:
                fill(p, 7919 * i)
                p.mul_(0.05).add_(1.0 if name.endswith("weight") else 0.0)
        for name, b in model.named_buffers():
            if name.endswith("running_var"):
                b.uniform_(0.5, 1.5, generator=gen)
            elif name.endswith("running_mean"):
                b.normal_(0, 0.1, generator=gen)
        model.mean.copy_(torch.tensor(IMAGENET_MEAN).view(1, -1, 1, 1))
        model.std.copy_(torch.tensor(IMAGENET_STD).view(1, -1, 1, 1))
    return model.eval()


def normalised(x):
    return (x - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(
        IMAGENET_STD).view(1, 3, 1, 1)


def test_every_imagenet_type_is_registered_once():
    names = model_names()
    assert all(names.count(t) == 1 for t in IMAGENET_TYPES)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", IMAGENET_TYPES)
def test_matches_timm_forward_for_the_same_weights(model_type):
    """Same parameter names and shapes as timm's network, and timm's logits (<= 1e-5) for the
    same weights on normalised inputs; 32 px keeps the big ones cheap on CPU."""
    ours = materialised(model_type)
    with torch.device("meta"):
        ref = timm_reference(model_type)
    own = ours.state_dict()
    assert {k: v.shape for k, v in ref.state_dict().items()} == {k: v.shape for k, v in own.items()}
    ref.load_state_dict(own, assign=True)  # shares our tensors: no second copy
    ref.eval()
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, expected = ours(x), ref(normalised(x))
    assert logits.shape == (2, NUM_CLASSES) and torch.isfinite(logits).all()
    assert (logits - expected).abs().max().item() <= 1e-5


def test_parameter_counts_of_the_large_models():
    """WideResNet-50-4 (timm's ResNet at base width 256, the `robustness` library's network) and
    ConvNeXt-L with and without the ConvStem, at 1000 classes."""
    with torch.device("meta"):
        counts = {name: sum(p.numel() for p in build_model(name, 1000, **opts).parameters())
                  for name, opts in (("WideResNet50x4ImageNet", {}), ("convnext_large", {}),
                                     ("ResNet50ImageNet", {}))}
        cvst = build_model("convnext_large", 1000, use_convstem=True)
    assert counts["ResNet50ImageNet"] == 25_557_032  # timm's resnet50
    assert counts["WideResNet50x4ImageNet"] == 223_439_144
    assert counts["convnext_large"] == 197_767_336  # timm's convnext_large
    assert [m.out_channels for m in cvst.stem.stem if isinstance(m, torch.nn.Conv2d)] == \
        [96, 144, 192]


def test_convstem_forward():
    """Singh et al.'s stem: conv3x3 -> channels-first LayerNorm -> GELU, per conv, written out."""
    model = build_model("convnext_test", NUM_CLASSES, use_convstem=True).eval()
    x = torch.rand(2, 3, 32, 32)
    out = x
    convs = [m for m in model.stem.stem if isinstance(m, torch.nn.Conv2d)]
    norms = [m for m in model.stem.stem if not isinstance(m, (torch.nn.Conv2d, torch.nn.GELU))]
    for conv, norm in zip(convs, norms, strict=True):
        out = F.conv2d(out, conv.weight, conv.bias, stride=conv.stride, padding=1)
        mu = out.mean(1, keepdim=True)
        var = (out - mu).pow(2).mean(1, keepdim=True)
        out = (out - mu) / torch.sqrt(var + 1e-6)
        out = F.gelu(norm.weight[:, None, None] * out + norm.bias[:, None, None])
    with torch.no_grad():
        assert torch.allclose(model.stem(x), out, atol=1e-5)
    assert out.shape[1] == 16 and out.shape[-1] == 8  # first stage width, stride 4
    assert sorted(k for k in model.state_dict() if k.startswith("stem."))[0] == "stem.stem.0.bias"


def test_normalize_input_false_feeds_raw_pixels():
    ours = materialised("convnext_test", normalize_input=False)
    with torch.device("meta"):
        ref = timm_reference("convnext_test")
    ref.load_state_dict(ours.state_dict(), assign=True)
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert (ours(x) - ref.eval()(x)).abs().max() <= 1e-5


def test_frozen_batchnorm_and_logits_of_y():
    model = build_model("TinyResNetImageNet", NUM_CLASSES)  # use_batchnorm=False by default
    model.train()
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns and all(not m.training for m in bns)
    before = bns[0].running_mean.clone()
    x, y = torch.rand(4, 3, 32, 32), torch.tensor([0, 3, 6, 1])
    logits = model(x)
    assert torch.equal(bns[0].running_mean, before)
    assert torch.equal(model(x, y), logits[torch.arange(4), y])
    live = build_model("TinyResNetImageNet", NUM_CLASSES, use_batchnorm=True).train()
    assert all(m.training for m in live.modules() if isinstance(m, torch.nn.BatchNorm2d))


def test_model_from_config_passes_the_convnext_options():
    cfg = TrainConfig()
    cfg.data = dataclasses.replace(cfg.data, num_classes=5)
    cfg.model = dataclasses.replace(cfg.model, model_type="convnext_test", use_convstem=True,
                                    normalize_input=False)
    model = model_from_config(cfg.model, cfg.data)
    assert model.use_convstem and not model.normalize_input
    assert "stem.stem.0.weight" in model.state_dict()
    cfg.model = dataclasses.replace(cfg.model, model_type="WideResNet10x1")  # takes neither
    assert model_from_config(cfg.model, cfg.data).fc.out_features == 5


@pytest.mark.parametrize("model_type,options", [("TinyResNetImageNet", {}),
                                                ("convnext_test", {"use_convstem": True})])
def test_channels_last_and_bf16_autocast(model_type, options):
    """model.channels_last gives the same logits up to rounding; amp: bf16 (autocast) runs and
    stays close, with input gradients for the attacks."""
    model = materialised(model_type, **options)
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = model(x)
        nhwc = model.to(memory_format=torch.channels_last)(x.to(memory_format=torch.channels_last))
    assert (nhwc - reference).abs().max() <= 1e-4
    x.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    grad, = torch.autograd.grad(logits.float().logsumexp(1).sum(), x)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    scale = reference.abs().max()
    assert (logits.float() - reference).abs().max() <= 0.1 * scale + 0.05
