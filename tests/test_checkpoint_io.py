"""load_checkpoint round trips across every layout (plain / DataParallel / DDP / EMA / compiled /
containers), into plain, DataParallel and DDP-wrapped models; readable errors; atomic saving."""

import argparse
import logging
import os

import pytest
import torch
import torch.nn as nn
from ema_pytorch import EMA
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel

from rebm.checkpoint.weights import (
    CheckpointError,
    atomic_torch_save,
    load_checkpoint,
    save_model,
)
from rebm.config import TrainConfig
from rebm.distributed import barrier, setup_distributed, teardown
from rebm.distributed.parallel import unwrap
from rebm.engine.build import build_model_all_ranks
from rebm.models import build_model
from tests.processes import spawn_ranks

pytestmark = pytest.mark.numbers

ARCH = "WideResNet10x1"


def _model(seed, arch=ARCH, num_classes=10):
    """A tiny model with random weights *and* random BN statistics (buffers must load too)."""
    torch.manual_seed(seed)
    model = build_model(arch, num_classes)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_(0, 0.1)
            m.running_var.uniform_(0.5, 1.5)
            m.bias.data.normal_(0, 0.1)
    return model.eval()


def _layouts(ref):
    """name -> object to torch.save; each must load back to exactly `ref`'s weights."""
    ema = EMA(_model(seed=1), beta=0.9)  # online weights differ from the EMA weights ...
    ema.ema_model.load_state_dict(ref.state_dict())  # ... which are the reference
    plain = ref.state_dict()
    return {
        "plain": plain,
        "dataparallel": nn.DataParallel(ref).state_dict(),
        "ema_pytorch": ema.state_dict(),
        "swa_averaged_model": AveragedModel(ref).state_dict(),
        "original_ema": nn.DataParallel(AveragedModel(ref)).state_dict(),  # module.n_averaged
        "compiled": torch.compile(ref).state_dict(),  # never run: no inductor on CPU
        "base_model": {f"base_model.{k}": v for k, v in plain.items()},
        "container_state_dict": {"state_dict": plain},
        "container_model_state_dict": {"model_state_dict": nn.DataParallel(ref).state_dict()},
        "nested_prefixes": {
            "state_dict": nn.DataParallel(torch.compile(AveragedModel(ref))).state_dict()
        },
        "training_state_only_ema": {"ema": ema.state_dict(), "step": 7, "optimizer": {}},
    }


LAYOUTS = (
    "plain",
    "dataparallel",
    "ema_pytorch",
    "swa_averaged_model",
    "original_ema",
    "compiled",
    "base_model",
    "container_state_dict",
    "container_model_state_dict",
    "nested_prefixes",
    "training_state_only_ema",
)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every layout written to disk, plus the input and reference output."""
    root = tmp_path_factory.mktemp("ckpts")
    ref = _model(seed=0)
    paths = {}
    for name, obj in _layouts(ref).items():
        paths[name] = str(root / f"{name}.pth")
        torch.save(obj, paths[name])
    assert set(paths) == set(LAYOUTS)
    x = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = ref(x)
    torch.save({"x": x, "out": out}, root / "ref.pt")
    return root, paths, x, out


def test_layouts_have_their_prefixes(files):
    _, paths, _, _ = files
    keys = {name: list(torch.load(p, weights_only=True)) for name, p in paths.items()}
    assert keys["dataparallel"][0].startswith("module.")
    assert "module.n_averaged" in keys["original_ema"]
    assert any(k.startswith("module.module.") for k in keys["original_ema"])
    assert {"initted", "step"} <= set(keys["ema_pytorch"])
    assert keys["compiled"][0].startswith("_orig_mod.")


@pytest.mark.parametrize("wrap", ["plain", "dataparallel"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip(files, layout, wrap):
    _, paths, x, out = files
    model = _model(seed=2)  # different weights and BN stats before loading
    target = nn.DataParallel(model) if wrap == "dataparallel" else model
    load_checkpoint(target, paths[layout])
    with torch.no_grad():
        assert torch.equal(target.eval()(x), out)


def _ddp_worker(root, paths):
    runtime = setup_distributed(use_ddp=True, device="cpu", timeout_s=60)
    try:
        ref = torch.load(os.path.join(root, "ref.pt"), weights_only=True)
        # DDP checkpoint: rank 0 saves ddp.state_dict() of a model holding the reference weights.
        source = _model(seed=3)
        load_checkpoint(source, paths["plain"])
        ddp_path = os.path.join(root, "ddp.pth")
        ddp = DDP(source, broadcast_buffers=False)
        if runtime.is_main:
            torch.save(ddp.state_dict(), ddp_path)
        barrier(runtime)
        for path in [*paths.values(), ddp_path]:
            model = DDP(_model(seed=4 + runtime.rank), broadcast_buffers=False)
            load_checkpoint(model, path)
            with torch.no_grad():
                assert torch.equal(model.eval()(ref["x"]), ref["out"]), path
        # The training entry point's path: build_model_all_ranks loads before wrapping in DDP.
        cfg = TrainConfig()
        cfg.model.model_type = ARCH
        cfg.model.ckpt_path = ddp_path
        wrapped, raw = build_model_all_ranks(cfg.network, runtime)
        assert isinstance(wrapped, DDP) and unwrap(wrapped) is raw
        expected = torch.load(paths["plain"], weights_only=True)
        assert all(torch.equal(v, expected[k]) for k, v in raw.state_dict().items())
        with torch.no_grad():  # channels_last (the CPU default) rounds differently
            assert torch.allclose(wrapped.eval()(ref["x"]), ref["out"], rtol=0, atol=1e-5)
        barrier(runtime)
    finally:
        teardown(runtime)


@pytest.mark.bridge
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_round_trip_ddp_two_processes(files):
    root, paths, x, out = files
    spawn_ranks(_ddp_worker, 2, str(root), paths)
    keys = list(torch.load(root / "ddp.pth", weights_only=True))
    assert keys and all(k.startswith("module.") for k in keys)
    model = _model(seed=5)
    load_checkpoint(model, root / "ddp.pth")
    with torch.no_grad():
        assert torch.equal(model(x), out)


def test_container_prefers_model_weights_unless_asked(tmp_path):
    model_w, ema_w = _model(seed=10), _model(seed=11)
    path = tmp_path / "state.pth"
    torch.save({"model": model_w.state_dict(), "ema": EMA(ema_w).state_dict(), "step": 3}, path)
    x = torch.rand(2, 3, 16, 16)
    target = _model(seed=12)
    load_checkpoint(target, path)
    assert torch.equal(target(x), model_w(x))
    load_checkpoint(target, path, prefer_ema=True)
    assert torch.equal(target(x), ema_w(x))


def test_original_states_with_python_objects_load_safely(tmp_path, caplog, monkeypatch):
    # Original training states pickle e.g. their argparse Namespace next to the weights: it is
    # on rebm's allow-list, so the file loads without ever unpickling arbitrary objects
    # (tests/test_hostile_files.py: what is not on it).
    ref = _model(seed=0)
    path = tmp_path / "orig_state.pth"
    torch.save({"args": argparse.Namespace(lr=0.1), "model_state_dict": ref.state_dict()}, path)
    monkeypatch.setattr(logging.getLogger("rebm"), "propagate", True)
    target = _model(seed=1)
    with caplog.at_level(logging.WARNING, logger="rebm"):
        load_checkpoint(target, path)
    assert "weights_only=False" not in caplog.text
    x = torch.rand(2, 3, 16, 16)
    assert torch.equal(target(x), ref(x))


def test_missing_num_batches_tracked_is_tolerated(tmp_path):
    ref = _model(seed=0)
    sd = {k: v for k, v in ref.state_dict().items() if not k.endswith("num_batches_tracked")}
    torch.save(sd, tmp_path / "old.pth")
    target = _model(seed=1)
    load_checkpoint(target, tmp_path / "old.pth")
    x = torch.rand(2, 3, 16, 16)
    assert torch.equal(target(x), ref(x))


def test_wrong_architecture_gives_short_diff(tmp_path):
    torch.save(nn.DataParallel(_model(0, "WideResNet16x2")).state_dict(), tmp_path / "big.pth")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(_model(1), tmp_path / "big.pth")
    msg = str(info.value)
    assert len(msg.splitlines()) < 15
    assert str(tmp_path / "big.pth") in msg
    assert "missing" in msg and "unexpected" in msg and "shape-mismatched" in msg
    assert "block1.layer.1." in msg  # an example key name (WRN-16 has 2 blocks per stage)
    assert "(+" in msg  # long lists are cut, not dumped
    assert "Error(s) in loading state_dict" not in msg  # not PyTorch's wall of text


def test_wrong_num_classes_names_the_key(tmp_path):
    torch.save(_model(0, num_classes=100).state_dict(), tmp_path / "c100.pth")
    target = _model(1)
    with pytest.raises(CheckpointError, match=r"0 missing, 0 unexpected, 2 shape-mismatched"):
        load_checkpoint(target, tmp_path / "c100.pth")
    with pytest.raises(CheckpointError, match=r"fc\.weight \(100, 64\) vs model \(10, 64\)"):
        load_checkpoint(target, tmp_path / "c100.pth")
    # strict=False loads everything that fits and leaves the head alone
    fc_before = target.fc.weight.clone()
    report = load_checkpoint(target, tmp_path / "c100.pth", strict=False)
    assert len(report.mismatched) == 2 and torch.equal(target.fc.weight, fc_before)
    assert torch.equal(target.conv1.weight, _model(0, num_classes=100).conv1.weight)


def _one_line_error(path):
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(_model(0), path)
    msg = str(info.value)
    assert len(msg.splitlines()) == 1 and str(path) in msg
    return msg


def test_unreadable_files_give_one_clear_line(tmp_path):
    good = tmp_path / "good.pth"
    torch.save(_model(0).state_dict(), good)
    data = good.read_bytes()
    (tmp_path / "truncated.pth").write_bytes(data[: len(data) // 2])
    (tmp_path / "notes.txt").write_text("this is not a checkpoint\n")
    (tmp_path / "empty.pth").write_bytes(b"")
    torch.save({"optimizer": {}, "epoch": 3}, tmp_path / "no_weights.pth")

    assert "truncated" in _one_line_error(tmp_path / "truncated.pth")
    assert "not a torch.save file" in _one_line_error(tmp_path / "notes.txt")
    assert "empty" in _one_line_error(tmp_path / "empty.pth")
    assert "does not exist" in _one_line_error(tmp_path / "nope.pth")
    assert "without model weights" in _one_line_error(tmp_path / "no_weights.pth")


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this")


def test_save_model_writes_plain_state_dict_atomically(tmp_path):
    ref = _model(0)
    path = tmp_path / "sub" / "model_final.pth"
    save_model(nn.DataParallel(torch.compile(ref)), path)
    sd = torch.load(path, weights_only=True)
    assert list(sd) == list(ref.state_dict())  # no prefixes
    assert os.listdir(path.parent) == ["model_final.pth"]  # no temp file left
    # A failing save leaves the previous file intact and no temp file behind.
    with pytest.raises(RuntimeError, match="cannot pickle"):
        atomic_torch_save({"bad": _Unpicklable()}, path)
    assert list(torch.load(path, weights_only=True)) == list(sd)
    assert os.listdir(path.parent) == ["model_final.pth"]
