"""`fuse_attacks`: DAT's two PGD attacks as one batched pass (rebm.attacks.fused) compute what
the two separate attacks compute, per sample, whatever the step counts, norms, radii, random
starts, batch order or world split; a compiled run still compiles two graphs; DDP equals one
process and resume stays bitwise with the fused pass."""

from __future__ import annotations

import math

import pytest
import torch

from rebm.attacks.fused import pgd_attack_streams
from rebm.attacks.pgd import AttackStream, pgd_attack_stream
from rebm.config import load_config, plan_batches
from rebm.data.pipeline import build_train_data
from rebm.distributed import Runtime, compile_cache
from rebm.distributed.precision import Precision
from rebm.engine.build import build_model_all_ranks
from rebm.engine.optimizers import build_optimizer
from rebm.methods.dat.dat import DAT, resolve_fuse_attacks
from rebm.models import build_model
from tests.helpers import (
    CONFIG,
    FAST,
    assert_states_identical,
    comparable,
    copy_run,
    load_state,
    max_param_diff,
    read_metrics,
    run_train,
)
from tests.steps import dat_update

pytestmark = [pytest.mark.timeout(240), pytest.mark.numbers]

B = 6  # per stream


@pytest.fixture(scope="module")
def model():
    """A real network as training attacks it: eval mode, channels_last, float32."""
    torch.manual_seed(0)
    return build_model("WideResNet10x1", 10).eval().to(memory_format=torch.channels_last)


def streams(T, K, *, random_start=True, neg_norm="L2", clf_norm="L2", n=B, seed=0):
    """The negatives' attack (f_y, radius inf, step 1.0) and the classifier batch's (CE)."""
    g = torch.Generator().manual_seed(seed)
    x_out, x_clf = torch.rand(n, 3, 16, 16, generator=g), torch.rand(n, 3, 16, 16, generator=g)
    y_in, y_clf = torch.randint(0, 10, (n,), generator=g), torch.randint(0, 10, (n,), generator=g)
    keys = torch.arange(2 * n, dtype=torch.int64) * 7919 + seed
    clf_eps, clf_step = (0.5, 0.1) if clf_norm == "L2" else (8 / 255, 2 / 255)
    negatives = AttackStream(x_out, T, 1.0 if neg_norm == "L2" else 4 / 255,
                             math.inf if neg_norm == "L2" else 16 / 255, neg_norm, "logit", y_in,
                             keys[:n] if random_start else None)
    classifier = AttackStream(x_clf, K, clf_step, clf_eps, clf_norm, "ce", y_clf,
                              keys[n:] if random_start else None, ce_batch_sizes=n)
    return negatives, classifier


def separate(model, attack_streams):
    return [pgd_attack_stream(model, s) for s in attack_streams]


def assert_close(fused, apart):
    for a, b in zip(fused, apart, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("T,K", [(4, 4), (5, 2), (2, 5), (0, 3), (3, 0), (0, 0)])
@pytest.mark.parametrize("random_start", [True, False])
def test_fused_equals_separate_whatever_the_step_counts(model, T, K, random_start):
    attack_streams = streams(T, K, random_start=random_start)
    fused = pgd_attack_streams(model, attack_streams)
    assert_close(fused, separate(model, attack_streams))
    for result, stream in zip(fused, attack_streams, strict=True):
        assert not result.requires_grad
        if stream.steps == 0:  # no step: the input itself, not a random start
            assert torch.equal(result, stream.x) and result.data_ptr() != stream.x.data_ptr()
        else:
            assert not torch.equal(result, stream.x)


@pytest.mark.parametrize("neg_norm,clf_norm", [("L2", "Linf"), ("Linf", "L2"), ("Linf", "Linf")])
def test_each_sample_keeps_its_norm_radius_and_step_size(model, neg_norm, clf_norm):
    attack_streams = streams(3, 4, neg_norm=neg_norm, clf_norm=clf_norm)
    fused = pgd_attack_streams(model, attack_streams)
    assert_close(fused, separate(model, attack_streams))
    for result, s in zip(fused, attack_streams, strict=True):
        delta = (result - s.x).flatten(1)
        size = delta.norm(dim=1) if s.norm == "L2" else delta.abs().amax(dim=1)
        assert bool((size <= s.eps + 1e-5).all())
        assert float(result.min()) >= 0.0 and float(result.max()) <= 1.0


def _rows(stream: AttackStream, index) -> AttackStream:
    keys = stream.random_start_keys
    return AttackStream(stream.x[index], stream.steps, stream.step_size, stream.eps, stream.norm,
                        stream.objective, stream.y[index], None if keys is None else keys[index],
                        stream.ce_batch_sizes)  # the CE's mean stays over the whole batch


def test_results_depend_on_each_samples_key_not_on_batch_order_or_world_split(model):
    """Rank shares (the first and last three rows of each stream, as two ranks hold them) and a
    permuted batch give each sample the result it gets in the whole batch."""
    whole = pgd_attack_streams(model, streams(4, 2))
    for rows in (slice(0, 3), slice(3, B)):
        part = pgd_attack_streams(model, [_rows(s, rows) for s in streams(4, 2)])
        assert_close(part, [w[rows] for w in whole])
    order = torch.randperm(B, generator=torch.Generator().manual_seed(3))
    permuted = pgd_attack_streams(model, [_rows(s, order) for s in streams(4, 2)])
    assert_close(permuted, [w[order] for w in whole])


def test_bad_arguments_are_one_line_errors(model):
    negatives, classifier = streams(2, 2)
    bad = AttackStream(classifier.x, 2, 0.1, 0.5, "L3", "ce", classifier.y)
    with pytest.raises(ValueError, match="norm must be one of"):
        pgd_attack_streams(model, [negatives, bad])
    no_labels = AttackStream(classifier.x, 2, 0.1, 0.5, "L2", "ce", None)
    with pytest.raises(ValueError, match="needs the labels y"):
        pgd_attack_streams(model, [negatives, no_labels])
    assert pgd_attack_streams(model, []) == []


@pytest.mark.parametrize("setting,device,expected", [
    ("auto", torch.device("cpu"), False), ("auto", torch.device("cuda", 0), True),
    (True, torch.device("cpu"), True), (False, torch.device("cuda", 0), False)])
def test_fuse_attacks_resolves_per_device(setting, device, expected):
    assert resolve_fuse_attacks(setting, device) is expected


def _update(cfg, model, raw, T):
    plan, precision = plan_batches(cfg.schedule, cfg.eval, 1), Precision(cfg.distributed.amp, torch.device("cpu"))
    optimizer = build_optimizer(cfg.optimization, raw.parameters())
    batches = next(iter(build_train_data(cfg.inputs, Runtime(), plan, DAT.streams)))
    return dat_update(model, optimizer, batches, T, cfg, plan, precision)


@pytest.mark.parametrize("T", [3, 1])
def test_a_dat_step_with_fused_attacks_equals_the_separate_one(T):
    """The whole update (its losses and the updated weights) with K = 2, T above and below it."""
    updated = {}
    for fuse in (False, True):
        cfg = load_config(CONFIG, ["batch_size=8", "indist_attack_clf.max_steps=2",
                                   f"fuse_attacks={str(fuse).lower()}"])
        torch.manual_seed(0)
        model, raw = build_model_all_ranks(cfg.network, Runtime())
        result = _update(cfg, model, raw, T)
        updated[fuse] = (float(result.loss), [p.detach().clone() for p in raw.parameters()])
    assert updated[True][0] == pytest.approx(updated[False][0], rel=1e-6, abs=1e-7)
    for a, b in zip(updated[True][1], updated[False][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_compiled_dat_run_with_fused_attacks_compiles_two_graphs_whatever_t():
    """T = K (one fused batch of 2B), T > K (2B, then a tail of B) and T = 0 (the classifier
    batch alone): the fused batch's size is marked dynamic, so the attack forward is one graph,
    and the loss forward the other (the `eager` backend: dynamo's graphs without inductor).
    A batch of 16 per stream: on one CPU thread the convolution's backend changes below 16
    images (a guard on the batch size), so smaller batches may add one graph there."""
    cfg = load_config(CONFIG, ["batch_size=16", "attack.start_step=1",
                               "indist_attack_clf.max_steps=1", "fuse_attacks=true"])
    torch.manual_seed(0)
    _, raw = build_model_all_ranks(cfg.network, Runtime())
    torch._dynamo.reset()
    model = torch.compile(raw, backend="eager")
    plan, precision = plan_batches(cfg.schedule, cfg.eval, 1), Precision(cfg.distributed.amp, torch.device("cpu"))
    optimizer = build_optimizer(cfg.optimization, raw.parameters())
    batches = iter(build_train_data(cfg.inputs, Runtime(), plan, DAT.streams))
    before = compile_cache.compiled_graphs()
    counts = []
    for T in (1, 1, 3, 0, 2):
        assert dat_update(model, optimizer, next(batches), T, cfg, plan, precision).finite
        counts.append(compile_cache.compiled_graphs() - before)
    assert counts == [2, 2, 2, 2, 2]


# ---------------------------------------------------------------------------------------------
# The run-level invariants with fuse_attacks=true (real entry point, torchrun for 2 processes)
# ---------------------------------------------------------------------------------------------
STEPS, STOP = 6, 3
FUSED = [*FAST, "fuse_attacks=true"]


@pytest.fixture(scope="module")
def fused_runs(tmp_path_factory):
    """STEPS steps on 1 and 2 processes, and a 1-process run stopped at STOP then continued."""
    root = tmp_path_factory.mktemp("fused")
    for nproc in (1, 2):
        run_train([CONFIG, *FUSED, f"max_steps={STEPS}"], nproc=nproc, run_dir=root / f"ws{nproc}",
                  timeout=400).assert_ok()
    run_train([CONFIG, *FUSED, f"max_steps={STOP}"], run_dir=root / "stopped",
              timeout=300).assert_ok()
    copy_run(root / "stopped", root / "resumed")
    result = run_train([CONFIG, *FUSED, f"max_steps={STEPS}"], run_dir=root / "resumed",
                       timeout=300).assert_ok()
    assert f"at step {STOP}" in result.output  # it resumed rather than restarted
    return root


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_fused_runs_keep_ddp_equal_to_one_process_and_resume_bitwise(fused_runs):
    one, two = load_state(fused_runs / "ws1", STEPS), load_state(fused_runs / "ws2", STEPS)
    # the bound of tests/test_train.py for DDP vs one process (float reduction order only)
    assert max_param_diff(one["model"], two["model"]) <= 1e-4
    assert one["method"]["curriculum"]["T"] == two["method"]["curriculum"]["T"]
    assert_states_identical(one, load_state(fused_runs / "resumed", STEPS))
    assert comparable(read_metrics(fused_runs / "resumed")) == comparable(
        read_metrics(fused_runs / "ws1"))
