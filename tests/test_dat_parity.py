"""Parity with the original DAT code: its Python API (a DAT script ported as a test), its
WideResNet constructor, its config fields and their ranges, and the behaviours of the fields
added for it (track_r1, Linf generation, blurred seeds)."""

from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.nn as nn
import yaml

from rebm.config import ConfigError, load_config, plan_batches
from rebm.data import build_train_data
from rebm.distributed import Runtime
from rebm.distributed.precision import Precision
from rebm.engine.build import build_model_all_ranks
from rebm.engine.optimizers import build_optimizer
from rebm.eval.sampling.generation import SeedImages, blur_kernel_size, gaussian_blur
from rebm.methods.dat import DAT, dat_loss, loss_options
from rebm.methods.dat.objective import r1_penalty
from rebm.models import build_model, dataset_stats
from rebm.models.wideresnet import WideResNet
from rebm.training.modeling import get_model, get_optimizer, load_checkpoint
from tests.helpers import randomise_bn as _randomise_bn  # non-trivial BatchNorm statistics
from tests.standins import generate_samples
from tests.steps import dat_update

pytestmark = [pytest.mark.timeout(120), pytest.mark.numbers]

DIGITS = "experiments/quickstart/digits.yaml"
CIFAR = "experiments/cifar10/cifar10-dat-WideResNet34x10-T40-seed0.yaml"


@dataclass
class BaseModelConfig:
    """The original's model config section (rebm/training/config_classes.py of DAT)."""

    model_type: str
    ckpt_path: Optional[str] = None
    which_logit: str = "first"
    normalize_input: bool = True
    use_batchnorm: bool = False
    use_layernorm: bool = True


# ---------------------------------------------------------------------------------------------
# The Python API and the WideResNet constructor
# ---------------------------------------------------------------------------------------------
def test_dat_positional_wideresnet_is_dats_network():
    with torch.device("meta"):
        net = WideResNet(28, 10, 10)  # DAT order: depth, num_classes, widen_factor
    assert net.fc.out_features == 10 and net.fc.in_features == 640 == net.nChannels
    assert len(net.block1.layer) == 4  # (28 - 4) / 6 blocks per stage
    n = sum(p.numel() for p in net.parameters())
    assert abs(n - 36.48e6) < 0.01e6, n  # published WRN-28-10 size
    assert net.use_batchnorm and net.normalize_input and not net.return_feature_map
    # All eight of the original's arguments, positionally
    small = WideResNet(10, 7, 1, "relu", 0.0, False, True, False)
    assert small.fc.out_features == 7 and not small.use_batchnorm
    # The registry builds by keyword, frozen BatchNorm by default, same names and logits
    torch.manual_seed(0)
    registered = _randomise_bn(build_model("WideResNet10x1", 7)).eval()
    assert not registered.use_batchnorm
    small.load_state_dict(registered.state_dict())
    x = torch.rand(3, 3, 32, 32)
    assert torch.equal(small.eval()(x), registered(x))


def test_dat_model_options():
    torch.manual_seed(0)
    base = _randomise_bn(WideResNet(10, 10, 1, use_batchnorm=False)).eval()
    keys = set(base.state_dict())
    x = torch.rand(2, 3, 32, 32)
    swish = WideResNet(10, 10, 1, "swish", use_batchnorm=False)
    dropout = WideResNet(10, 10, 1, dropRate=0.3, use_batchnorm=False)
    features = WideResNet(10, 10, 1, return_feature_map=True, use_batchnorm=False)
    for model in (swish, dropout, features):
        assert set(model.state_dict()) == keys  # no option adds state
        model.load_state_dict(base.state_dict())
    assert not torch.allclose(swish.eval()(x), base(x))
    assert torch.equal(dropout.eval()(x), base(x))  # dropout only in train mode
    torch.manual_seed(1)
    assert not torch.equal(dropout.train()(x), base(x))
    assert features.eval()(x).shape == (2, 64)
    torch.testing.assert_close(base.fc(features(x)), base(x))
    with pytest.raises(ValueError, match="relu, swish"):
        WideResNet(10, 10, 1, "gelu")
    with pytest.raises(ValueError, match="dropRate"):
        WideResNet(10, 10, 1, dropRate=1.0)


def test_dat_script_saves_and_loads_the_dat_way(tmp_path):
    """A DAT-style script: build positionally, save a DataParallel (`module.`) state dict, load it
    with load_checkpoint and get_model called as the original calls them."""
    torch.manual_seed(0)
    trained = _randomise_bn(WideResNet(10, 10, 1, use_batchnorm=False))
    path = tmp_path / "model_final.pth"
    torch.save(nn.DataParallel(trained).state_dict(), path)
    assert next(iter(torch.load(path))).startswith("module.")

    fresh = WideResNet(10, 10, 1, use_batchnorm=False)
    assert load_checkpoint(fresh, str(path)) is fresh  # returns the model, as the original
    wrapped = load_checkpoint(nn.DataParallel(WideResNet(10, 10, 1)), str(path), weights_only=True)
    model_config = BaseModelConfig(model_type="WideResNet10x1", ckpt_path=str(path))
    dat_model = get_model(model_config=model_config, device=torch.device("cpu"), num_classes=10,
                          indist_dataset="cifar10", use_ddp=False, rank=0)
    assert isinstance(dat_model, nn.DataParallel)

    mean, std = dataset_stats("cifar10")
    reference = build_model("WideResNet10x1", 10, mean=mean, std=std)
    reference.load_state_dict(trained.state_dict())
    x = torch.rand(4, 3, 32, 32)
    expected = reference.eval()(x)
    for model in (fresh, wrapped, dat_model):
        assert torch.equal(model.eval()(x), expected)

    optimizer = get_optimizer(model=dat_model, optimizer_name="adam", lr=1e-3, wd=5e-4)
    assert isinstance(optimizer, torch.optim.Adam)
    assert optimizer.param_groups[0]["betas"] == (0.0, 0.99)


# ---------------------------------------------------------------------------------------------
# Config fields and ranges
# ---------------------------------------------------------------------------------------------
def test_dat_config_with_the_new_fields_loads(tmp_path):
    original = yaml.safe_load(open(CIFAR))
    original["track_r1"] = True
    original["image_log"].update(norm="Linf", eps=0.03, blur_kernel_size=5, adaptive_blur=True,
                                 adaptive_steps=True, step_sweep_range=[1, 5, 10],
                                 sweep_radius=3, sweep_num_samples=100)
    path = tmp_path / "dat.yaml"
    path.write_text(yaml.safe_dump(original))
    cfg = load_config(str(path))
    assert cfg.method.track_r1 and cfg.image_log.norm == "Linf" and cfg.image_log.adaptive_blur
    assert cfg.image_log.step_sweep_range == [1, 5, 10] and cfg.image_log.blur_kernel_size == 5


@pytest.mark.parametrize("override, expected", [
    ("AUC_th=1.5", "'AUC_th' must be in [0, 1]"),
    ("AUC_th=-0.1", "'AUC_th' must be in [0, 1]"),
    ("ema_decay=1.0", "'ema_decay' must be in [0, 1)"),
    ("wd=-1", "'wd' must be >= 0"),
    ("r1reg=-0.5", "'r1reg' must be >= 0"),
    ("data.num_classes=0", "'data.num_classes' must be >= 1"),
    ("image_log.num_samples=0", "'image_log.num_samples' must be a positive integer"),
    ("image_log.sweep_num_samples=0", "'image_log.sweep_num_samples' must be a positive"),
    ("image_log.norm=L1", "'image_log.norm: L1' is not a valid choice; use one of L2, Linf"),
    ("image_log.blur_kernel_size=4", "'image_log.blur_kernel_size' must be 0 (no blur) or an odd"),
    ("image_log.blur_kernel_size=-3", "'image_log.blur_kernel_size' must be 0 (no blur) or an odd"),
    ("image_log.sweep_radius=-1", "'image_log.sweep_radius' must be >= 0"),
    ("image_log.step_sweep_range=[0,5]", "'image_log.step_sweep_range' must be a non-empty list"),
    ("image_log.step_sweep_range=[]", "'image_log.step_sweep_range' must be a non-empty list"),
])
def test_bad_ranges_are_one_line_errors(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(DIGITS, [override])
    message = str(err.value)
    assert expected in message and "\n" not in message, message


def test_range_edges_are_accepted():
    cfg = load_config(DIGITS, ["AUC_th=1.0", "image_log.blur_kernel_size=1",
                               "image_log.sweep_radius=0", "image_log.step_sweep_range=[1]"])
    assert cfg.method.AUC_th == 1.0


# ---------------------------------------------------------------------------------------------
# track_r1
# ---------------------------------------------------------------------------------------------
def _one_step(track_r1: bool, log_now: bool, r1reg: float = 0.0):
    cfg = load_config(DIGITS, ["batch_size=8", "per_device_batch_size=4", "attack.start_step=1",
                               "indist_attack_clf.max_steps=1", f"r1reg={r1reg}",
                               f"track_r1={str(track_r1).lower()}"])
    runtime = Runtime()
    plan = plan_batches(cfg.schedule, cfg.eval, runtime.world_size)
    torch.manual_seed(0)
    wrapped, raw = build_model_all_ranks(cfg.network, runtime)
    optimizer = build_optimizer(cfg.optimization, raw.parameters())
    batches = next(iter(build_train_data(cfg.inputs, runtime, plan, DAT.streams)))
    result = dat_update(wrapped, optimizer, batches, 1, cfg, plan, Precision("none", runtime.device),
                      log_now=log_now)
    params = [p.detach().clone() for p in raw.state_dict().values()]
    return cfg, result, params


def test_track_r1_logs_without_training_on_it():
    cfg, off, params_off = _one_step(track_r1=False, log_now=True)
    _, on, params_on = _one_step(track_r1=True, log_now=True)
    assert all(torch.equal(a, b) for a, b in zip(params_off, params_on, strict=True))
    assert float(on.loss) == float(off.loss)  # the logged total is the trained loss
    assert float(off.losses["r1"]) == 0.0 and float(on.losses["r1"]) > 0.0
    # Logged as train_r1_loss: averaged over the log steps, other terms over every step
    method = DAT(cfg.method, cfg.model, cfg.schedule)
    quiet = dict(off.window)  # a step without a log: r1 contributes nothing
    totals = {k: on.window.get(k, 0.0) + quiet.get(k, 0.0) for k in {*on.window, *quiet}}
    logged = method.summarize(totals)
    assert logged["train_r1_loss"] == pytest.approx(float(on.losses["r1"]))
    assert logged["train_clf_loss"] == pytest.approx(
        (float(on.losses["clf"]) + float(off.losses["clf"])) / 2)
    # Not a log step: nothing measured
    _, silent, params_silent = _one_step(track_r1=True, log_now=False)
    assert float(silent.losses["r1"]) == 0.0 and "n_r1" not in silent.window
    assert all(torch.equal(a, b) for a, b in zip(params_off, params_silent, strict=True))


def test_r1_penalty_is_the_trained_term_without_weight():
    torch.manual_seed(0)
    model = _randomise_bn(build_model("WideResNet10x1", 10)).eval()
    x, y = torch.rand(6, 3, 16, 16), torch.randint(0, 10, (6,))
    cfg = load_config(DIGITS, ["r1reg=2.0"])
    trained = dat_loss(model, x, y, torch.rand(6, 3, 16, 16), torch.rand(6, 3, 16, 16), y, None,
                       loss_options(cfg.method, cfg.model)).terms["r1"]
    measured = r1_penalty(model, x, y, logsumexp=True)
    torch.testing.assert_close(measured, trained.detach() / 2.0)
    assert all(p.grad is None and p.requires_grad for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# Generation: Linf, blurred seeds
# ---------------------------------------------------------------------------------------------
def _generation_cfg(*overrides):
    return load_config(DIGITS, ["image_log.seed_images=noise", "image_log.num_samples=12",
                                "image_log.num_steps=4", *overrides])


def test_linf_generation_stays_in_the_linf_ball():
    torch.manual_seed(0)
    model = build_model("WideResNet10x1", 10, mean=(0.5,) * 3, std=(0.5,) * 3)
    eps = 0.05
    cfg = _generation_cfg("image_log.norm=Linf", f"image_log.eps={eps}",
                          "image_log.step_size=0.02")
    images, labels = generate_samples(model, cfg, Runtime(), batch_size=5)
    seeds = SeedImages("noise", 16, cfg.schedule.rand_seed)(torch.arange(12))
    delta = (images - seeds).abs()
    assert delta.max() <= eps + 1e-6 and delta.max() > eps / 2
    assert images.min() >= 0 and images.max() <= 1
    l2 = _generation_cfg("image_log.eps=0.05", "image_log.step_size=0.02")
    assert not torch.equal(generate_samples(model, l2, Runtime(), batch_size=5)[0], images)


def test_blur_kernel_size_rule():
    assert blur_kernel_size(load_config(DIGITS).evaluation) == 0
    assert blur_kernel_size(load_config(DIGITS, ["image_log.blur_kernel_size=5"]).evaluation) == 5
    for size, expected in ((16, 3), (32, 5), (64, 11), (224, 35)):
        cfg = load_config(DIGITS, ["image_log.blur_kernel_size=5", "image_log.adaptive_blur=true",
                                   "image_log.seed_images=noise", f"data.image_size={size}"])
        assert blur_kernel_size(cfg.evaluation) == expected


def test_blurred_seeds_are_deterministic_and_shard_invariant():
    from torchvision.transforms.functional import gaussian_blur as tv_blur

    n = 11
    plain = SeedImages("noise", 16, rand_seed=3)(torch.arange(n))
    blurred = SeedImages("noise", 16, rand_seed=3, blur_kernel_size=5)
    full = blurred(torch.arange(n))
    assert not torch.equal(full, plain) and torch.equal(full, blurred(torch.arange(n)))
    torch.testing.assert_close(full, tv_blur(plain, [5, 5]), rtol=0, atol=1e-6)
    for world in (2, 3):  # rank r takes indices r, r + W, ...
        shards = [blurred(torch.arange(r, n, world)) for r in range(world)]
        for r, shard in enumerate(shards):
            assert torch.equal(shard, full[r::world])
    wide = gaussian_blur(plain, 41)  # wider than the image: reflect padding still defined
    assert wide.shape == plain.shape and wide.std() < plain.std()
    cfg = _generation_cfg("image_log.blur_kernel_size=5", "image_log.blur_fid_seeds=true",
                          "image_log.num_steps=0")
    images, _ = generate_samples(build_model("WideResNet10x1", 10), cfg, Runtime(), batch_size=5)
    expected = SeedImages("noise", 16, cfg.schedule.rand_seed, blur_kernel_size=5)(torch.arange(12))
    assert torch.equal(images, expected)
