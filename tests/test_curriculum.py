"""ROC-AUC against sklearn, and the attack-step curriculum."""

import io
import math

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from rebm.auc import binary_auc
from rebm.config import TrainConfig
from rebm.methods.dat.curriculum import Curriculum

pytestmark = pytest.mark.numbers


@pytest.mark.parametrize("n_pos,n_neg,levels", [(50, 70, None), (128, 128, 5), (7, 300, 3), (1, 1, None), (40, 3, 2)])
def test_auc_equals_sklearn(n_pos, n_neg, levels):
    rng = np.random.default_rng(n_pos * 1000 + n_neg)
    for _ in range(5):
        pos = rng.normal(0.5, 1.0, n_pos)
        neg = rng.normal(0.0, 1.0, n_neg)
        if levels is not None:  # heavy ties, also across the two classes
            pos, neg = np.round(pos * levels) / levels, np.round(neg * levels) / levels
        ref = roc_auc_score(np.r_[np.ones(n_pos), np.zeros(n_neg)], np.r_[pos, neg])
        auc = binary_auc(torch.from_numpy(pos).float(), torch.from_numpy(neg).float())
        ref32 = roc_auc_score(np.r_[np.ones(n_pos), np.zeros(n_neg)],
                              np.r_[pos.astype(np.float32), neg.astype(np.float32)])
        assert auc.dtype == torch.float64 and auc.dim() == 0
        assert abs(auc.item() - ref32) < 1e-12
        if levels is not None:
            assert abs(auc.item() - ref) < 1e-12


def test_auc_edge_cases():
    assert binary_auc(torch.ones(4), torch.ones(6)).item() == 0.5
    assert binary_auc(torch.tensor([2.0, 3.0]), torch.tensor([0.0, 1.0])).item() == 1.0
    assert binary_auc(torch.tensor([0.0, 1.0]), torch.tensor([2.0, 3.0])).item() == 0.0
    with pytest.raises(ValueError):
        binary_auc(torch.ones(3), torch.ones(0))


def make_cfg(**kw):
    cfg = TrainConfig()
    cfg.method.attack.start_step, cfg.method.attack.max_steps = kw.pop("start", 0), kw.pop("max_steps", 3)
    cfg.schedule.batch_size = kw.pop("batch_size", 128)
    cfg.method.min_imgs_per_threshold = kw.pop("min_imgs", 1000)  # window = ceil(1000/128) = 8 steps
    cfg.method.AUC_th = kw.pop("th", 0.8)
    cfg.method.samples_per_attack_step = kw.pop("samples", None)
    assert not kw
    return cfg


def test_from_config_window():
    cur = Curriculum.from_config(make_cfg(start=1).method, make_cfg(start=1).schedule.batch_size)
    assert cur.T == 1 and cur.window.maxlen == math.ceil(1000 / 128) == 8
    exact = Curriculum.from_config(make_cfg(batch_size=100).method, make_cfg(batch_size=100).schedule.batch_size)
    assert exact.window.maxlen == 10  # exact division


def test_advances_exactly_when_full_window_mean_crosses_threshold():
    cur = Curriculum.from_config(make_cfg().method, make_cfg().schedule.batch_size)
    # a high AUC advances only once the window is full, then the window restarts empty
    assert [cur.update(0.99, 128) for _ in range(8)] == [False] * 7 + [True]
    assert cur.T == 1 and len(cur.window) == 0 and cur.images_at_T == 0
    # the window slides: early low values keep the mean below threshold until they drop out
    assert [cur.update(a, 128) for a in [0.0, 0.0] + [0.95] * 6] == [False] * 8
    assert cur.window_mean == pytest.approx(6 * 0.95 / 8)
    assert cur.update(0.95, 128) is True  # oldest 0.0 drops out: mean 7 * 0.95 / 8 >= 0.8
    assert cur.T == 2 and len(cur.window) == 0


def test_threshold_is_inclusive():
    cur = Curriculum(start_step=0, max_T=5, auc_threshold=0.75, window_size=2)
    assert cur.update(0.5, 10) is False
    assert cur.update(1.0, 10) is True  # mean exactly 0.75 (binary-exact values)
    # just below: mean 0.74951171875 (exact) does not advance
    assert cur.update(0.5, 10) is False and cur.update(0.9990234375, 10) is False
    assert cur.window_mean == 0.74951171875 and cur.T == 1


def test_never_past_max_steps():
    # a window of 1
    cur = Curriculum.from_config(make_cfg(start=1, max_steps=2, min_imgs=128).method, make_cfg(start=1, max_steps=2, min_imgs=128).schedule.batch_size)
    assert cur.update(1.0, 128) is True and cur.T == 2
    assert not any(cur.update(1.0, 128) for _ in range(20))
    assert cur.T == 2
    zero = Curriculum(start_step=0, max_T=0, auc_threshold=0.0, window_size=1)
    assert zero.update(1.0, 1) is False and zero.T == 0
    with pytest.raises(ValueError):
        Curriculum(start_step=3, max_T=2, auc_threshold=0.8, window_size=1)


def test_samples_per_attack_step_mode():
    cur = Curriculum.from_config(make_cfg(samples=300, max_steps=2).method, make_cfg(samples=300, max_steps=2).schedule.batch_size)
    # AUC is irrelevant: advance after 300 images at the current T (128-image steps: 3rd step)
    assert [cur.update(0.0, 128) for _ in range(3)] == [False, False, True]
    assert cur.T == 1 and cur.images_at_T == 0
    assert [cur.update(1.0, 128) for _ in range(3)] == [False, False, True]
    assert cur.T == 2 and not any(cur.update(1.0, 128) for _ in range(10))


def test_state_round_trip_resumes_exactly():
    rng = np.random.default_rng(0)
    aucs = rng.uniform(0.6, 1.0, 200).tolist()
    ref = Curriculum.from_config(make_cfg(max_steps=10).method, make_cfg(max_steps=10).schedule.batch_size)
    ref_out = [ref.update(a, 128) for a in aucs]
    cur = Curriculum.from_config(make_cfg(max_steps=10).method, make_cfg(max_steps=10).schedule.batch_size)
    out = [cur.update(a, 128) for a in aucs[:77]]
    state = cur.state_dict()
    assert len(state["window"]) > 0  # mid-window, the interesting case
    buf = io.BytesIO()
    torch.save(state, buf)  # as inside a training-state file
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    resumed = Curriculum.from_config(make_cfg(max_steps=10).method, make_cfg(max_steps=10).schedule.batch_size)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == cur.state_dict()
    out += [resumed.update(a, 128) for a in aucs[77:]]
    assert out == ref_out and resumed.state_dict() == ref.state_dict() and any(ref_out)
