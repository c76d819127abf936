"""The memory plan of `--check` (rebm.models.memory): its arithmetic, the largest micro-batch that
fits, and its prediction against the measured heap peak of a real small training step on CPU."""

import argparse
import copy
import ctypes
import ctypes.util
import gc
import os

import pytest
import torch

from rebm.cli import pop_check_options
from rebm.config import ConfigError
from rebm.models import build_model
from rebm.models.memory import MemoryPlan, activation_bytes_per_image, plan_memory
from rebm.training import train as train_entry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc without mallinfo2 (needs glibc >= 2.33)")
    libc.mallinfo2.restype = _MallInfo2
    return libc


def heap_in_use(libc) -> int:
    """Bytes the C heap has handed out: the main arena's in-use chunks plus mmapped blocks (torch's
    CPU tensors come from malloc; large ones are mmapped). One thread, so one arena."""
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def measured_step_peak(model_type, image_size, micro_batch, streams, optimizer, **options):
    """Peak heap growth of a real training step on CPU, in steady state (the second step: the
    optimizer state exists, the gradients were set to None): model + EMA copy, fused forward of
    `streams` micro-batches, backward, optimizer step. Sampled whenever autograd saves or reuses a
    tensor, a gradient lands, and after the step."""
    libc = _libc()
    gc.collect()
    base = heap_in_use(libc)
    peak = [0]

    def sample(*_):
        peak[0] = max(peak[0], heap_in_use(libc) - base)

    model = build_model(model_type, 10, **options)
    ema = copy.deepcopy(model)
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-3))
    model.train()
    x = torch.rand(streams * micro_batch, 3, image_size, image_size)

    def step():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sample() or t,
                                                      lambda t: sample() or t):
            loss = model(x.clone().requires_grad_(True)).logsumexp(1).mean()
        loss.backward()
        sample()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sample()

    step()
    peak[0] = 0
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(sample)
    step()
    del ema
    return peak[0]


def test_plan_arithmetic_and_largest_batch():
    plan = MemoryPlan(parameters=100, gradients=100, optimizer_state=200, ema=100,
                      ddp_buckets=100, activation_bytes_per_image=10,
                      images_in_largest_pass=30, micro_batch=10, streams=3)
    assert plan.fixed == 600 and plan.activations == 300 and plan.total == 900
    # (1000 * 0.9 - 600) / (10 * 3) = 10
    assert plan.largest_micro_batch(1000) == 10
    assert plan.largest_micro_batch(500) == 0
    assert any("total" in line for line in plan.lines())


def test_plan_counts_optimizer_ema_and_ddp():
    model = build_model("TinyResNetImageNet", 10)
    n = sum(p.numel() * 4 for p in model.parameters())
    sgd = plan_memory(model, 32, 4, 3, "sgd", use_ema=True, world_size=2)
    adamw = plan_memory(model, 32, 4, 3, "adamw", use_ema=False, world_size=1)
    assert (sgd.parameters, sgd.gradients, sgd.optimizer_state, sgd.ema, sgd.ddp_buckets) == \
        (n, n, n, n, n)
    assert (adamw.optimizer_state, adamw.ema, adamw.ddp_buckets) == (2 * n, 0, 0)
    assert sgd.images_in_largest_pass == 12
    # a larger evaluation batch makes evaluation the largest pass
    assert plan_memory(model, 32, 4, 3, "sgd", True, 1, eval_batch=20).images_in_largest_pass == 20


def test_activations_scale_with_image_area():
    model = build_model("convnext_test", 10, use_convstem=True)
    small = activation_bytes_per_image(model, 32)
    large = activation_bytes_per_image(model, 64)
    assert 3.0 < large / small < 4.5  # ~ (64/32)^2, minus the size-independent head


@pytest.mark.parametrize("model_type,options,optimizer", [
    ("TinyResNetImageNet", {}, "sgd"),
    ("convnext_test", {"use_convstem": True}, "adamw"),
])
def test_plan_predicts_measured_peak_of_a_small_step(model_type, options, optimizer):
    """The plan's total for a small run against the heap peak that run really reaches."""
    torch.manual_seed(0)
    image_size, micro_batch, streams = 64, 4, 3
    plan = plan_memory(build_model(model_type, 10, **options), image_size, micro_batch, streams,
                       optimizer, use_ema=True, world_size=1)
    measured = measured_step_peak(model_type, image_size, micro_batch, streams, optimizer,
                                  **options)
    assert 0.8 * measured < plan.total < 1.35 * measured, (plan.total, measured)


def test_check_prints_memory_plan_and_largest_batch(capsys, monkeypatch):
    """The real entry function, in process (as test_config.py runs --check)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    try:
        code = train_entry.main([os.path.join(REPO, "experiments", "quickstart", "digits.yaml"),
                                 "--check", "gpu_mem_gib=1",
                                 "model.model_type=TinyResNetImageNet"])
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr().out
    assert code in (0, None)
    assert "# memory plan per device (world size 2, micro-batch 32 x 3 streams" in out
    assert "DDP gradient buckets" in out
    fits = int(out.split("that fits 1 GiB")[1].split(": ")[1].split()[0])
    assert fits > 32


@pytest.mark.parametrize("overrides,check,expected", [
    (["lr=0.1", "gpu_mem_gib=40"], True, 40.0),
    (["lr=0.1"], True, None),
    (["gpu_mem_gib=lots"], True, "gpu_mem_gib must be a number of GiB"),
    (["gpu_mem_gib=80"], False, "'gpu_mem_gib=80' only goes with --check"),
])
def test_gpu_mem_gib_is_taken_out_of_the_overrides(overrides, check, expected):
    args = argparse.Namespace(overrides=list(overrides), check=check)
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=expected):
            pop_check_options(args)
        return
    assert pop_check_options(args) == expected and args.overrides == ["lr=0.1"]
