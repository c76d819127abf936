"""The one-line summary of an evaluation (rebm/eval/results.py `describe_evaluation`, the line
`python -m rebm.eval.evaluate` logs and training logs at every evaluation) follows the registry:
each registered metric's `summary_values`, in registry order, a stand-in's or unverified
weights' values labelled as such."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from tests.helpers import CONFIG, REPO, base_env, finish
from tests.processes import popen
from tests.standins import STANDIN, standin_features, write_standin_statistics

pytestmark = pytest.mark.timeout(300)

N_TEST = 40


def _checkpoint(tmp_path):
    """A random-weight digits WideResNet-10-1 (what the values are does not matter here)."""
    from rebm.models import build_model, dataset_stats

    torch.manual_seed(0)
    mean, std = dataset_stats("digits")
    path = tmp_path / "model_final.pth"
    torch.save(build_model("WideResNet10x1", 10, mean=mean, std=std).state_dict(), path)
    return path


def _standin_statistics(tmp_path):
    """FID reference statistics of the stand-in network, from random images (FID only has to
    be computed, not to mean anything)."""
    from rebm.eval.features.fid import feature_statistics

    torch.manual_seed(1)
    mu, sigma = feature_statistics(standin_features(torch.rand(64, 3, 32, 32)).numpy())
    path = tmp_path / "stats.npz"
    write_standin_statistics(path, mu, sigma)
    return path


def test_a_newly_registered_metric_is_in_the_summary_line(tmp_path):
    """tests/evaluate_with_extra_metrics.py registers two metrics as rebm's own are (a class
    in METRICS): the real entry point's summary line shows the one with a declared label by
    that label, the other by its name, after the registered ones; the stand-in's FID and IS
    read 'stand-in'."""
    ckpt, stats = _checkpoint(tmp_path), _standin_statistics(tmp_path)
    cmd = [sys.executable, "-m", "tests.evaluate_with_extra_metrics", str(REPO / CONFIG),
           f"model.ckpt_path={ckpt}", f"eval.num_images={N_TEST}",
           "indist_attack_clf.max_steps=1", "robust_eval_steps=1", "--samples",
           "image_log.num_samples=10", "image_log.num_steps=1", "image_log.log_fid=true",
           f"image_log.data_dir={stats}",
           "--metrics", "misclassified,mean_confidence,inception_score"]
    code, out = finish(popen(cmd, base_env(1, {"REBM_FID_FEATURES": STANDIN}), REPO),
                       timeout=240)
    assert code == 0, out[-4000:]
    values = json.loads(out.strip().splitlines()[-1])
    assert values["misclassified"] == round((1 - values["test_acc"]) * N_TEST)
    assert "fid" not in values and "inception_score" not in values  # the stand-in's keys only
    expected = " | ".join([
        f"clean acc {values['test_acc']:.3f}",
        f"robust acc {values['robust_test_acc']:.3f}",
        f"ECE {values['ece']:.3f}",
        f"stand-in FID {values['fid_standin']:.2f}",
        f"stand-in IS {values['inception_score_standin']:.2f}",
        f"misclassified test images {values['misclassified']}",
        f"mean_confidence {values['mean_confidence']:.4g}",
    ]) + f" ({N_TEST} test images)"
    summary = [line for line in out.splitlines() if "clean acc " in line]
    assert len(summary) == 1 and summary[0].endswith(f"INFO {expected}"), out[-4000:]
    assert np.isfinite(values["fid_standin"])
