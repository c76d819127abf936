"""The speed options' defaults: `model.channels_last: auto` (on for CPU, so the exactness tests
of the suite run on it), and `model.compile`'s cache across restarts and its graph count."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch

from rebm.checkpoint.run_directory import RunDirectory
from rebm.config import ConfigError, load_config, plan_batches
from rebm.data.pipeline import build_train_data
from rebm.distributed import Runtime, compile_cache
from rebm.distributed.parallel import resolve_channels_last
from rebm.distributed.precision import Precision
from rebm.engine.build import build_model_all_ranks
from rebm.engine.compiling import REPAYING_STEPS, decide_compile
from rebm.engine.optimizers import build_optimizer
from rebm.methods.dat.dat import DAT
from rebm.training.train import make_training_method
from tests.helpers import REPO, TRAINING_CONFIGS, base_env, run_command
from tests.steps import dat_update

pytestmark = pytest.mark.timeout(240)

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize("setting,device,amp,expected", [
    ("auto", CPU, "none", True), ("auto", CPU, "bf16", True),
    ("auto", CUDA, "bf16", True), ("auto", CUDA, "fp16", True), ("auto", CUDA, "none", False),
    ("auto", torch.device("mps"), "none", False),
    (False, CPU, "none", False), (True, CUDA, "none", True),
])
def test_auto_resolves_per_device_and_precision(setting, device, amp, expected):
    assert resolve_channels_last(setting, device, amp) is expected


def test_default_is_channels_last_on_cpu(caplog):
    cfg = load_config("experiments/quickstart/digits.yaml")
    assert cfg.model.channels_last == "auto"
    torch.manual_seed(0)
    with caplog.at_level("INFO", logger="rebm"):
        model, raw = build_model_all_ranks(cfg.network, Runtime())
    convs = [m for m in raw.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(c.weight.is_contiguous(memory_format=torch.channels_last)
                         for c in convs)
    assert not raw.conv1.weight.is_contiguous()  # a 3x3 kernel: NHWC differs from NCHW
    assert "speed options: channels_last on (model.channels_last=auto)" in caplog.text
    assert "compile off" in caplog.text


def test_exactness_tests_run_on_the_default():
    """The DDP == one process, bit-identical resume and 1/2/3-rank evaluation tests use the
    shipped configs without touching `model.channels_last`, so on CPU they test channels_last."""
    for path in TRAINING_CONFIGS:
        cfg = load_config(str(path))
        assert resolve_channels_last(cfg.model.channels_last, CPU, cfg.distributed.amp), path
    switched_off = re.compile(r"channels_last\s*[=:]\s*(false|False)")
    for test_file in (REPO / "tests").glob("test_*.py"):
        if test_file.name != Path(__file__).name:
            assert not switched_off.search(test_file.read_text()), test_file


@pytest.mark.parametrize("value,expected", [("true", True), ("false", False), ("auto", "auto")])
def test_existing_boolean_values_still_load(tmp_path, value, expected):
    path = tmp_path / "c.yaml"
    path.write_text(f"model:\n  model_type: WideResNet10x1\n  channels_last: {value}\n")
    assert load_config(str(path)).model.channels_last == expected
    assert load_config(None, [f"model.channels_last={value}"]).model.channels_last == expected


def test_a_bad_value_names_the_key():
    with pytest.raises(ConfigError, match=r"'model.channels_last: fast' is not valid; use true"):
        load_config(None, ["model.channels_last=fast"])


@pytest.mark.slow
def test_dat_run_compiles_two_graphs_whatever_t():
    """Dynamo's graph count over DAT steps with a changing T and log steps: the attack forward
    (its input requires grad) and the loss forward; T is a Python loop count and recompiles
    nothing, and a log step's no-grad scores use the uncompiled module.
    (The `eager` backend: dynamo's guards and graphs without inductor's slow CPU codegen.)"""
    cfg = load_config("experiments/quickstart/digits.yaml", [
        "batch_size=8", "attack.start_step=1", "indist_attack_clf.max_steps=1",
        "fuse_attacks=false"])  # the separate attacks (tests/test_fused_attacks.py: the fused)
    runtime, plan = Runtime(), plan_batches(cfg.schedule, cfg.eval, 1)
    torch.manual_seed(0)
    _, raw = build_model_all_ranks(cfg.network, runtime)
    torch._dynamo.reset()
    model = torch.compile(raw, backend="eager")
    optimizer = build_optimizer(cfg.optimization, raw.parameters())
    precision = Precision(cfg.distributed.amp, runtime.device)
    batches = iter(build_train_data(cfg.inputs, runtime, plan, DAT.streams))
    before = compile_cache.compiled_graphs()
    counts = []
    for T, log_now in ((1, False), (1, True), (2, False), (3, True)):
        # a log step's clean-score forward (no grad) runs uncompiled: no third graph
        assert dat_update(model, optimizer, next(batches), T, cfg, plan, precision,
                          log_now=log_now).finite
        counts.append(compile_cache.compiled_graphs() - before)
    assert counts == [2, 2, 2, 2]


CACHE_PROBE = """
import sys, torch
from torch._dynamo.utils import counters
from rebm.distributed import compile_cache
from rebm.checkpoint.run_directory import RunDirectory
cache, phrase = compile_cache.open_cache(
    RunDirectory(sys.argv[1]).compile_cache(compile_cache.cache_key(torch.device('cpu'), {})),
    True)
print(phrase)
model = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                          torch.nn.Linear(16, 2)))
model(torch.rand(4, 8)).sum().backward()
cache.after_step()
print('hits', counters['inductor']['fxgraph_cache_hit'], counters['aot_autograd']['autograd_cache_hit'])
"""


@pytest.mark.slow
def test_compile_cache_survives_a_restart_on_a_fresh_node(tmp_path):
    """Two processes, each with an empty local inductor cache (a restart on another node): the
    second loads what the first saved under the run dir and compiles nothing afresh."""
    run_dir = tmp_path / "run"

    def attempt(n: int):
        env = base_env(1, {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"local{n}"),
                           "PYTHONPATH": str(REPO)})
        result = run_command([sys.executable, "-c", CACHE_PROBE, str(run_dir)], 200, env)
        result.assert_ok()
        return result.output

    first = attempt(1)
    assert "(empty: the first compile is saved there)" in first and "hits 0 0" in first
    saved = list((run_dir / "compile_cache").glob("*.bin"))
    assert len(saved) == 1 and saved[0].stat().st_size > 0
    second = attempt(2)
    assert re.search(r"\(loaded [1-9]\d* artifacts\)", second), second
    hits = re.search(r"hits (\d+) (\d+)", second)
    assert hits and int(hits.group(1)) >= 1 and int(hits.group(2)) >= 1, second


def test_an_unreadable_cache_file_is_replaced(tmp_path):
    key = compile_cache.cache_key(CPU, {"model": "x"})
    assert key != compile_cache.cache_key(CPU, {"model": "y"})
    path = tmp_path / RunDirectory.COMPILE_CACHE / f"{key}.bin"
    path.parent.mkdir()
    path.write_bytes(b"not a cache")
    assert "unreadable" in compile_cache.open_cache(str(path), writer=True)[1]


# ---------------------------------------------------------------------------------------------
# model.compile: auto
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting,device,steps,enabled", [
    ("auto", CPU, 220, False), ("auto", CPU, REPAYING_STEPS - 1, False),
    ("auto", CPU, REPAYING_STEPS, True), ("auto", CUDA, 39_000, True),
    ("auto", CPU, math.inf, True), ("auto", CPU, 0, False),
    ("auto", torch.device("mps"), 39_000, False),
    (True, CPU, 3, True), (False, CUDA, 39_000, False),
])
def test_compile_auto_depends_on_the_planned_length_only(setting, device, steps, enabled):
    choice = decide_compile(setting, device, steps)
    assert choice.enabled is enabled
    assert choice.describe().startswith("on (" if enabled else "off (")
    assert f"model.compile={str(setting).lower()}" in choice.reason


def test_a_bad_compile_value_names_the_key():
    with pytest.raises(ConfigError, match=r"'model.compile: fast' is not valid; use true"):
        load_config(None, ["model.compile=fast"])
    assert load_config("experiments/quickstart/digits.yaml").model.compile == "auto"


@pytest.mark.parametrize("overrides,compiled", [
    ([], False),  # the quickstart config as shipped (stage 2 has its length): 220 steps
    (["total_epochs=100"], True),  # a paper-length run of the same model
])
def test_the_start_up_line_says_whether_auto_compiles_and_why(tmp_path, overrides, compiled):
    """The Trainer as `train` builds it (compilation itself is lazy: nothing runs here); the
    line as the run's log file has it."""
    from torch._dynamo.eval_frame import OptimizedModule

    from rebm.engine.trainer import Trainer

    cfg = load_config("experiments/quickstart/digits.yaml",
                      [*overrides, f"run_dir={tmp_path}", "wandb_mode=disabled"])
    trainer = Trainer(cfg, Runtime(), make_training_method)
    steps = int(trainer.last_step)
    assert (steps >= REPAYING_STEPS) is compiled
    log = (tmp_path / "logs" / "rank0.log").read_text()
    line = next(x for x in log.splitlines() if "speed options" in x)
    expected = (f"compile on (model.compile=auto: {steps} planned steps" if compiled
                else f"compile off (model.compile=auto: {steps} planned steps, fewer than")
    assert expected in line, line
    assert "speed options: attacks in two passes (fuse_attacks=auto: off for cpu)" in log
    assert isinstance(trainer.parts.model, OptimizedModule) is compiled
    assert (trainer.parts.compile_cache is not None) is compiled
