"""WideResNet structure/semantics, the classifier contract (rebm.models.base), the registry, and
the engine's model/optimizer construction in one process. Multi-process loading is in
test_checkpoint_io.py."""

import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from rebm.checkpoint.weights import save_model
from rebm.config import TrainConfig
from rebm.distributed import Runtime
from rebm.distributed.parallel import unwrap
from rebm.engine.build import build_model_all_ranks
from rebm.engine.optimizers import build_optimizer
from rebm.models import MODEL_NAMES, build_model, dataset_stats
from rebm.models.base import Classifier
from rebm.models.stats import CIFAR10_MEAN, CIFAR10_STD
from rebm.models.wideresnet import ARCHITECTURES

pytestmark = pytest.mark.numbers


def _randomise_bn(model, seed=0):
    """Non-trivial BN statistics/affine, so tests see whether BN is applied as the original."""
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
    return model


def test_model_names_match_factory():
    assert set(ARCHITECTURES) <= set(MODEL_NAMES)  # the ImageNet ones: test_models_imagenet.py


def test_models_package_import_does_not_import_torch():
    # Config validation imports MODEL_NAMES; that must stay cheap.
    code = "import sys, rebm.models; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_wrn34_10_parameter_count():
    with torch.device("meta"):  # no memory, no init cost
        model = build_model("WideResNet34x10", num_classes=10)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - 46.16e6) < 0.005e6, n  # published figure: 46.16M


def test_state_dict_names_are_the_original_ones():
    keys = set(build_model("WideResNet16x2", 10).state_dict())
    # n = (16 - 4) / 6 = 2 blocks per stage; widths 16 -> 32 -> 64 -> 128
    for stage in (1, 2, 3):
        for i in (0, 1):
            for part in (
                "bn1.weight",
                "bn1.running_var",
                "conv1.weight",
                "bn2.bias",
                "conv2.weight",
            ):
                assert f"block{stage}.layer.{i}.{part}" in keys
        assert f"block{stage}.layer.0.convShortcut.weight" in keys  # widths differ
        assert f"block{stage}.layer.1.convShortcut.weight" not in keys
    assert {"conv1.weight", "bn1.weight", "bn1.running_mean", "fc.weight", "fc.bias"} <= keys
    assert "conv1.bias" not in keys and "mean" not in keys and "std" not in keys
    # widen factor 1: block1 keeps 16 channels, so no shortcut conv there
    keys1 = set(build_model("WideResNet10x1", 10).state_dict())
    assert "block1.layer.0.convShortcut.weight" not in keys1
    assert "block2.layer.0.convShortcut.weight" in keys1


def _reference_forward(sd, x, mean, std):
    """The original forward written out functionally from the state dict."""

    def bn(prefix, h):
        return F.batch_norm(
            h,
            sd[prefix + ".running_mean"],
            sd[prefix + ".running_var"],
            sd[prefix + ".weight"],
            sd[prefix + ".bias"],
            False,
            0.0,
            1e-5,
        )

    h = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    h = F.conv2d(h, sd["conv1.weight"], padding=1)
    for stage, stride in ((1, 1), (2, 2), (3, 2)):
        i = 0
        while f"block{stage}.layer.{i}.conv1.weight" in sd:
            p = f"block{stage}.layer.{i}"
            s = stride if i == 0 else 1
            pre = F.relu(bn(p + ".bn1", h))
            out = F.conv2d(pre, sd[p + ".conv1.weight"], stride=s, padding=1)
            out = F.conv2d(F.relu(bn(p + ".bn2", out)), sd[p + ".conv2.weight"], padding=1)
            short = p + ".convShortcut.weight"
            h = (F.conv2d(pre, sd[short], stride=s) if short in sd else h) + out
            i += 1
    h = F.relu(bn("bn1", h))
    h = F.avg_pool2d(h, 8).flatten(1)  # the original pools 8x8 at 32 px
    return F.linear(h, sd["fc.weight"], sd["fc.bias"])


@pytest.mark.parametrize("name", ["WideResNet10x1", "WideResNet16x2"])
def test_forward_matches_original_semantics(name):
    torch.manual_seed(0)
    model = _randomise_bn(build_model(name, 10)).eval()
    x = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        ours = model(x)
        ref = _reference_forward(model.state_dict(), x, CIFAR10_MEAN, CIFAR10_STD)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", [16, 32])
def test_forward_with_labels_gathers_logits(size):
    torch.manual_seed(0)
    model = build_model("WideResNet10x1", 7).eval()
    x = torch.rand(5, 3, size, size)
    y = torch.tensor([0, 6, 3, 3, 1])
    logits = model(x)
    assert logits.shape == (5, 7)
    assert torch.equal(model(x, y), logits[torch.arange(5), y])


def test_normalisation_is_inside_the_model():
    torch.manual_seed(0)
    model = build_model("WideResNet10x1", 10).eval()
    raw = build_model("WideResNet10x1", 10, normalize_input=False).eval()
    raw.load_state_dict(model.state_dict())
    x = torch.rand(2, 3, 16, 16)
    mean = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(model(x), raw((x - mean) / std))
    custom = build_model("WideResNet10x1", 10, mean=(0.5,) * 3, std=(0.5,) * 3)
    assert torch.equal(custom.mean.flatten(), torch.full((3,), 0.5))
    assert "mean" not in custom.state_dict()


def test_dataset_stats():
    assert dataset_stats("cifar10") == (CIFAR10_MEAN, CIFAR10_STD)
    assert dataset_stats("cifar100-conditional") == (CIFAR10_MEAN, CIFAR10_STD)
    assert dataset_stats("imagefolder") == (CIFAR10_MEAN, CIFAR10_STD)
    assert dataset_stats("digits") == ((0.5,) * 3, (0.5,) * 3)
    assert CIFAR10_MEAN[0] == 0.4913997551666284 and CIFAR10_STD[2] == 0.26158783926049628


def test_unknown_model_type_names_choices():
    with pytest.raises(ValueError, match="WideResNet34x10"):
        build_model("ResNet50", 10)


def _bn_stats(model):
    return [m.running_mean.clone() for m in model.modules() if isinstance(m, nn.BatchNorm2d)]


def test_frozen_batchnorm_keeps_running_stats():
    torch.manual_seed(0)
    model = build_model("WideResNet10x1", 10, use_batchnorm=False)
    wrapped = nn.DataParallel(model)  # wrappers call .train() recursively: the rule still holds
    wrapped.eval()
    wrapped.train()
    assert model.training
    assert all(not m.training for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    before = _bn_stats(model)
    model(torch.rand(4, 3, 16, 16)).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(before, _bn_stats(model), strict=True))
    assert model.bn1.weight.grad is not None  # gamma/beta still learn


def test_live_batchnorm_updates_running_stats():
    torch.manual_seed(0)
    model = build_model("WideResNet10x1", 10, use_batchnorm=True).train()
    before = _bn_stats(model)
    model(torch.rand(4, 3, 16, 16))
    assert not any(torch.equal(a, b) for a, b in zip(before, _bn_stats(model), strict=True))


def test_unwrap_strips_nested_wrappers():
    model = build_model("WideResNet10x1", 10)
    assert unwrap(model) is model
    assert unwrap(nn.DataParallel(torch.compile(nn.DataParallel(model)))) is model


def _cfg(**model_fields):
    cfg = TrainConfig()
    cfg.model.model_type = "WideResNet10x1"
    for key, value in model_fields.items():
        setattr(cfg.model, key, value)
    return cfg


def test_build_model_loads_ckpt_single_process(tmp_path):
    torch.manual_seed(0)
    source = _randomise_bn(build_model("WideResNet10x1", 10)).eval()
    save_model(nn.DataParallel(source), tmp_path / "m.pth")
    cfg = _cfg(ckpt_path=str(tmp_path / "m.pth"), channels_last=True)
    wrapped, raw = build_model_all_ranks(cfg.network, Runtime())
    assert wrapped is raw and isinstance(raw, nn.Module)
    assert raw.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.rand(2, 3, 32, 32)
    torch.testing.assert_close(raw.eval()(x), source(x))


def test_build_model_data_parallel():
    cfg = _cfg()
    wrapped, raw = build_model_all_ranks(cfg.network, Runtime(data_parallel=True))
    assert isinstance(wrapped, nn.DataParallel) and unwrap(wrapped) is raw


def test_get_optimizer():
    cfg = _cfg()
    params = list(build_model("WideResNet10x1", 10).parameters())
    cfg.optimization.name, cfg.optimization.lr, cfg.optimization.wd = "sgd", 0.1, 5e-4
    opt = build_optimizer(cfg.optimization, params)
    group = opt.param_groups[0]
    assert isinstance(opt, torch.optim.SGD) and group["nesterov"] and group["momentum"] == 0.9
    assert group["lr"] == 0.1 and group["weight_decay"] == 5e-4
    cfg.optimization.name = "adam"
    assert build_optimizer(cfg.optimization, params).param_groups[0]["betas"] == (0.0, 0.99)
    cfg.optimization.name = "adamw"
    opt = build_optimizer(cfg.optimization, params)
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["betas"] == (0.9, 0.95)


def test_no_import_cycle_between_rebm_modules():
    """Module-level and function-level imports alike (grimp, import-linter's graph): no file of
    rebm reaches itself through its imports."""
    import grimp

    graph = grimp.build_graph("rebm")
    cycles = [(m, other) for m in graph.modules for other in graph.find_modules_directly_imported_by(m)
              if graph.chain_exists(importer=other, imported=m)]
    assert not cycles, cycles


class _TwoLayerFamily(Classifier):
    """A family as small as it gets: what it writes is its layers and logits()."""

    default_stats = ((0.5,) * 3, (0.25,) * 3)

    def __init__(self, num_classes: int, use_batchnorm: bool = False, **options):
        super().__init__()
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3, num_classes)
        self.init_classifier(use_batchnorm=use_batchnorm, **options)

    def logits(self, x):
        return self.fc(self.bn(self.normalize(x)).mean((2, 3)))


def test_the_contract_holds_for_any_family():
    torch.manual_seed(0)
    model = _TwoLayerFamily(4, normalize_input=True).train()
    assert not model.bn.training and model.training  # frozen BatchNorm
    assert "mean" not in model.state_dict() and model.mean.flatten().tolist() == [0.5] * 3
    x, y = torch.rand(3, 3, 8, 8), torch.tensor([3, 0, 2])
    logits = model(x)
    assert torch.equal(model(x, y), logits[torch.arange(3), y])
    raw = _TwoLayerFamily(4, normalize_input=False).eval()
    raw.load_state_dict(model.state_dict())
    torch.testing.assert_close(raw((x - 0.5) / 0.25), model.eval()(x))
    assert _TwoLayerFamily(4, use_batchnorm=True, normalize_input=True).train().bn.training


def test_family_options_are_declared_by_the_family():
    from rebm.config import ConfigError, load_config
    from rebm.models import family_options

    assert family_options("convnext_test") == ("use_convstem", "use_layernorm")
    assert family_options("WideResNet10x1") == ()
    load_config(None, ["model.model_type=convnext_test", "model.use_convstem=true"])
    with pytest.raises(ConfigError, match="'model.use_convstem: True' is an option of other"):
        load_config(None, ["model.model_type=WideResNet10x1", "model.use_convstem=true"])
