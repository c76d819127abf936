"""The classifier attack's cross-entropy is the original's batch MEAN, over the batch the
original attacked as one, on any split rebm makes of it.

The original's `pgd_attack_xent` (rebm/attacks/adv_attacks.py:116-175 at fb2ffc7) ascends
`F.cross_entropy(logits, y)`: in DAT training over its global batch (DataParallel gathers the
logits), in robust accuracy over its evaluation batch (the last one shorter). rebm weights each
sample's CE by 1/N (`rebm.attacks.pgd.ce_weights`); a sum equals the mean only at a power-of-two
N, so these tests use 17 and chains of 40 steps.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rebm.attacks.argmin_pgd import argmin_pgd_attack
from rebm.attacks.fused import pgd_attack_streams
from rebm.attacks.pgd import AttackStream, pgd_attack, pgd_attack_stream
from rebm.data.indexing import eval_chunks
from rebm.eval.metrics.accuracy import original_eval_batch_sizes
from rebm.models import build_model
from tests.helpers import CONFIG
from tests.processes import spawn_ranks
from tests.test_attacks import TinyNet, original_step

pytestmark = pytest.mark.numbers

B = 17  # not a power of two: 1/17 is inexact in float32
HALVES = (slice(0, 9), slice(9, B))
MICRO = (slice(0, 6), slice(6, 12), slice(12, B))


class OneByOne(nn.Module):
    """Each sample through the network alone: which rows a kernel computes together cannot move
    a sample's bits, so a comparison of splits sees the attack's own arithmetic only."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, y=None):
        return torch.cat([self.net(x[i:i + 1]) for i in range(x.shape[0])])


def batch(n=B, seed=1, side=16):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, side, side, generator=g), torch.randint(0, 10, (n,), generator=g)


def original_xent(model, x, y, steps, step_size, eps, norm, reduction="mean"):
    """The original's pgd_attack_xent written out: the CE of the batch it is given (its mean;
    `reduction="sum"` is rebm's former objective), then its L2Step/LinfStep step and project."""
    x0, x_adv = x.clone(), x.clone()
    for _ in range(steps):
        x_adv = x_adv.clone().detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(F.cross_entropy(model(x_adv), y, reduction=reduction),
                                      [x_adv])
        with torch.no_grad():
            x_adv = original_step(x_adv, x0, grad, step_size, eps, norm)
    return x_adv.detach()


def input_grad(model, x, loss_of_logits):
    x = x.clone().requires_grad_(True)
    return torch.autograd.grad(loss_of_logits(model(x)), x)[0]


def test_weighted_sum_seeds_the_means_input_gradient_bit_for_bit():
    """sum_i CE_i * w_i with w_i = 1/17 in float32 gives the input gradient of the mean over
    17, and so do its halves of 9 and 8 computed in two calls; the sum does not."""
    torch.manual_seed(0)
    model = OneByOne(TinyNet(10).eval())
    x, y = batch()
    mean = input_grad(model, x, lambda logits: F.cross_entropy(logits, y))
    w = torch.ones(()) / torch.tensor(float(B))

    def weighted(rows):
        return input_grad(model, x[rows], lambda logits: (
            F.cross_entropy(logits, y[rows], reduction="none") * w).sum())

    assert torch.equal(weighted(slice(None)), mean)
    assert torch.equal(torch.cat([weighted(rows) for rows in HALVES]), mean)
    summed = input_grad(model, x, lambda logits: F.cross_entropy(logits, y, reduction="sum"))
    assert not torch.equal(summed / B, mean)  # the sum scaled afterwards rounds otherwise


@pytest.mark.parametrize("norm,step_size,eps", [("L2", 0.1, 0.5), ("L2", 0.1, math.inf),
                                                ("Linf", 2 / 255, 8 / 255)])
def test_40_steps_are_the_originals_mean_not_the_sum(norm, step_size, eps):
    """rebm's 40-step CE chain on a batch of 17 equals the original's formula bit for bit; the
    former objective (the sum) fails the same assertion under L2. Under Linf only sign(g) moves
    x, so the sum parts from the mean only where rounding flips a component's sign (27 values of
    this Linf chain on the machine the test was written on, none on others maybe): Linf asserts
    the equality only."""
    torch.manual_seed(1)
    model = build_model("WideResNet10x1", 10).eval()
    x, y = batch()
    kw = dict(steps=40, step_size=step_size, eps=eps, norm=norm)
    original = original_xent(model, x, y, **kw)
    assert torch.equal(pgd_attack(model, x, objective="ce", y=y, **kw), original)
    assert torch.equal(pgd_attack(model, x, objective="ce", y=y, ce_batch_sizes=B, **kw), original)
    if norm == "L2":
        assert not torch.equal(original_xent(model, x, y, reduction="sum", **kw), original)


def _stream(x, y, rows, **kw):
    return AttackStream(x[rows], kw.pop("steps"), kw.pop("step_size"), kw.pop("eps"),
                        kw.pop("norm"), "ce", y[rows], ce_batch_sizes=B, **kw)


@pytest.mark.parametrize("norm,step_size,eps", [("L2", 0.1, 0.5), ("Linf", 2 / 255, 8 / 255)])
def test_a_sample_gets_the_same_bits_however_rebm_splits_the_batch(norm, step_size, eps):
    """The original's batch of 17 attacked whole, as two ranks' shares (9 + 8), as micro-batches
    (6 + 6 + 5), fused with the negatives' attack, and from keyed random starts: every sample
    gets the whole batch's bits (ce_batch_sizes = 17 wherever it sits)."""
    torch.manual_seed(0)
    model = OneByOne(TinyNet(10).eval())
    x, y = batch()
    keys = torch.arange(B, dtype=torch.int64) * 7919
    kw = dict(steps=40, step_size=step_size, eps=eps, norm=norm)
    whole = pgd_attack_stream(model, _stream(x, y, slice(None), **kw))
    assert torch.equal(whole, original_xent(model, x, y, **kw))
    for parts in (HALVES, MICRO):
        split = [pgd_attack_stream(model, _stream(x, y, rows, **kw)) for rows in parts]
        assert torch.equal(torch.cat(split), whole)
    x_out, _ = batch(seed=2)
    negatives = AttackStream(x_out[:9], 25, 1.0, math.inf, "L2", "logit", y[:9])
    fused = [pgd_attack_streams(model, [negatives, _stream(x, y, rows, **kw)])[1]
             for rows in HALVES]
    assert torch.equal(torch.cat(fused), whole)
    started = pgd_attack_stream(model, _stream(x, y, slice(None), random_start_keys=keys, **kw))
    halves = [pgd_attack_stream(model, _stream(x, y, rows, random_start_keys=keys[rows], **kw))
              for rows in HALVES]
    assert torch.equal(torch.cat(halves), started)


def test_stage1_argmin_attack_is_the_mean_over_in_n_outs_batch_on_any_split():
    """In-N-Out's ArgminPGD takes the mean of its batch's loss (utils/adversarial_attacks/
    argmin_pgd.py): rebm's, told the batch of 17, gives its rows the whole batch's bits."""
    torch.manual_seed(0)
    model = OneByOne(TinyNet(10).eval())
    x, y = batch()
    kw = dict(steps=40, step_size=0.1, eps=0.5, norm="L2")
    whole = argmin_pgd_attack(model, x, y, **kw)
    assert torch.equal(argmin_pgd_attack(model, x, y, ce_batch_sizes=B, **kw), whole)
    halves = [argmin_pgd_attack(model, x[rows], y[rows], ce_batch_sizes=B, **kw)
              for rows in HALVES]
    assert torch.equal(torch.cat(halves), whole)


def test_robust_accuracy_divides_by_the_originals_evaluation_batch_on_any_chunking():
    """101 test images in the original's batches of 17: five of 17 and a last one of 16,
    whatever rebm's evaluation batch and world size (its chunks hold other positions)."""
    n, original_batch = 101, 17
    expected = torch.tensor([17] * 85 + [16] * 16)
    assert torch.equal(original_eval_batch_sizes(torch.arange(n), n, original_batch), expected)
    for chunk, world in ((16, 1), (16, 2), (5, 3), (128, 1)):
        for rank in range(world):
            for positions in eval_chunks(n, chunk, rank, world):
                got = original_eval_batch_sizes(torch.arange(positions.start, positions.stop),
                                                n, original_batch)
                assert torch.equal(got, expected[positions.start:positions.stop])


# ---------------------------------------------------------------------------------------------
# DAT's classifier attack from the real data pipeline on 1 and 2 processes (gloo)
# ---------------------------------------------------------------------------------------------
DAT_OVERRIDES = ["batch_size=18", "attack.start_step=2", "attack.max_steps=2",
                 "indist_attack_clf.max_steps=5", "indist_attack_clf.random_start=true"]


def _dat_attack_worker(out_dir: str, extra: list, fuse: bool) -> None:
    """This rank's first step: every micro-batch's classifier attack, by per-sample key."""
    from rebm import distributed as rd
    from rebm.config import load_config, plan_batches
    from rebm.data import CLASSIFIER
    from rebm.data.pipeline import build_train_data
    from rebm.methods.dat.dat import DAT, dat_attacks

    runtime = rd.setup_distributed()
    cfg = load_config(CONFIG, [*DAT_OVERRIDES, *extra])
    plan = plan_batches(cfg.schedule, cfg.eval, runtime.world_size)
    torch.manual_seed(0)
    model = OneByOne(build_model("WideResNet10x1", 10).eval())
    step = next(iter(build_train_data(cfg.inputs, runtime, plan, DAT.streams)))
    found = {}
    for micro in step:
        _, x_c_adv = dat_attacks(model, cfg.method, 2, micro, fuse, cfg.schedule.batch_size)
        found.update(zip(micro[CLASSIFIER.name].keys.tolist(), x_c_adv, strict=True))
    torch.save(found, os.path.join(out_dir, f"rank{runtime.rank}.pt"))
    rd.teardown(runtime)


def _dat_attacks(out_dir, world, extra=(), fuse=False) -> dict:
    os.makedirs(out_dir)
    spawn_ranks(_dat_attack_worker, world, out_dir, list(extra), fuse)
    found = {}
    for rank in range(world):
        found.update(torch.load(os.path.join(out_dir, f"rank{rank}.pt")))
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dat_classifier_attack_is_the_same_on_1_and_2_ranks_and_micro_batches(tmp_path):
    """A global batch of 18 (the original's mean over 18) as one micro-batch on one process,
    as 9 + 9 on two processes, and as three micro-batches of 6 fused with the negatives: every
    image gets the same bits."""
    one = _dat_attacks(str(tmp_path / "ws1"), 1)
    assert len(one) == 18
    for found in (_dat_attacks(str(tmp_path / "ws2"), 2),
                  _dat_attacks(str(tmp_path / "micro"), 1, ["per_device_batch_size=6"], True)):
        assert found.keys() == one.keys()
        for key, x_c_adv in one.items():
            assert torch.equal(found[key], x_c_adv), key
