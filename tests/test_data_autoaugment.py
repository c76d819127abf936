"""`autoaugment_cutout` applies the original's AutoAugment CIFAR-10 policy
(InNOutRobustness/utils/datasets/augmentations/autoaugment.py at xuwangyin/DAT fb2ffc7), not
torchvision's: against the original's own outputs on fixed images under fixed draws.

CI has no copy of the original, so its outputs are stored: tests/data/original_autoaugment.npz,
written by `python -m benchmarks.original.autoaugment_outputs --mirror DAT.git`, which runs the
original's file from a `git archive` of its repository with Python's `random` replaced by the
chosen draws (the file records the Pillow and numpy versions; they were Pillow 13.0.0, numpy
2.4.6). Stored on another machine, so the outputs are compared with a tolerance: at most 1 of 255
on any value, which covers a rounding change between Pillow versions of the resamplings and
enhancements and still fails every difference of the policy (a rotation's direction or fill, the
shears' resampling, a solarize threshold: 255 - 2v on the pixels of value v it moves). Spread
measured: no value differs here, under the native and the forced CPU dispatch (`make
test-dispatch`; Pillow's operations do not follow torch's).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from rebm.data.augmentations import Cutout, build_augmentation
from rebm.data.autoaugment import (
    CIFAR10_POLICY,
    CIFAR10Policy,
    PolicyDraw,
    apply_subpolicy,
    draw,
    magnitude,
)
from tests.helpers import REPO

STORED = REPO / "tests" / "data" / "original_autoaugment.npz"
pytestmark = pytest.mark.numbers


@pytest.fixture(scope="module")
def original():
    with np.load(STORED, allow_pickle=False) as stored:
        return {key: stored[key] for key in stored.files}


def test_policy_table_is_the_originals(original):
    """Probabilities and magnitudes of the 25 sub-policies, as the original's objects hold them."""
    ours = [(p1, p2, magnitude(op1, i1), magnitude(op2, i2))
            for p1, op1, i1, p2, op2, i2 in CIFAR10_POLICY]
    assert np.allclose(np.array(ours, dtype=np.float64), original["policy"], rtol=1e-12, atol=0)


def test_operations_are_the_originals_on_fixed_images_and_draws(original):
    images = original["images"]
    worst, differing = 0, 0
    for case, k in enumerate(original["index"].tolist()):
        p1, _, _, p2, _, _ = CIFAR10_POLICY[k]
        u1, u2 = original["uniforms"][case].tolist()
        s1, s2 = original["signs"][case].tolist()
        choice = PolicyDraw(k, (u1 < p1, u2 < p2), (s1, s2))
        image = Image.fromarray(images[original["image"][case]])
        ours = np.asarray(apply_subpolicy(image, choice, (0, 0, 0)), dtype=np.int16)
        gap = np.abs(ours - original["outputs"][case].astype(np.int16))
        assert gap.max() <= 1, (f"sub-policy {k} {CIFAR10_POLICY[k]}, draw {choice}: "
                                f"{int((gap > 1).sum())} values differ by up to {gap.max()}")
        worst, differing = max(worst, int(gap.max())), differing + int((gap > 0).sum())
    print(f"{len(original['index'])} cases, Pillow {original['pillow']} stored: "
          f"{differing} values differ by {worst} at most")


def test_torch_draws_follow_the_policy():
    """`draw` picks sub-policies uniformly, applies each operation with its probability and
    signs both ways, from torch's generator (so a sample's seed fixes it)."""
    torch.manual_seed(0)
    draws = [draw() for _ in range(5000)]
    counts = np.bincount([d.index for d in draws], minlength=25)
    assert counts.min() > 5000 / 25 * 0.7 and counts.max() < 5000 / 25 * 1.3
    for k, (p1, _, _, p2, _, _) in enumerate(CIFAR10_POLICY):
        mine = [d for d in draws if d.index == k]
        for slot, p in ((0, p1), (1, p2)):
            rate = np.mean([d.applies[slot] for d in mine])
            assert abs(rate - p) < 4 * np.sqrt(p * (1 - p) / len(mine)) + 1e-9, (k, slot, rate)
    assert 0.45 < np.mean([d.signs[0] == 1 for d in draws]) < 0.55
    torch.manual_seed(7)
    first = draw()
    torch.manual_seed(7)
    assert draw() == first


def test_autoaugment_cutout_is_the_originals_composition():
    """Crop (padding 4 at 32 px, fill 0), flip, the policy (fill 0), Cutout 16 (fill 0): the
    original's cifar_augmentation.py:54-60, 102-106 with DAT's mean (0, 0, 0)."""
    transform = build_augmentation("autoaugment_cutout", 32)
    crop, flip, policy, cutout = transform.transforms
    assert isinstance(crop, v2.RandomCrop) and crop.padding == [4, 4, 4, 4]
    assert crop.fill == 0 and crop.padding_mode == "constant"
    assert isinstance(flip, v2.RandomHorizontalFlip) and flip.p == 0.5
    assert isinstance(policy, CIFAR10Policy) and policy.fill == (0, 0, 0)
    assert isinstance(cutout, Cutout) and cutout.size == 16 and cutout.fill == 0

    image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    torch.manual_seed(3)
    out = policy(image)
    torch.manual_seed(3)
    choice = draw()
    expected = apply_subpolicy(Image.fromarray(image.permute(1, 2, 0).numpy()), choice, (0, 0, 0))
    assert out.dtype == torch.uint8 and np.array_equal(out.permute(1, 2, 0).numpy(),
                                                      np.asarray(expected))
    assert policy(image.float() / 255).dtype == torch.float32
