"""Files rebm did not write are never unpickled into arbitrary objects: a checkpoint or a CIFAR
batch whose pickle would run code is refused in one line, and the code does not run."""

from __future__ import annotations

import argparse
import os
import pickle
import sys

import numpy as np
import pytest
import torch

from rebm.checkpoint.weights import CheckpointError, load_checkpoint, read_checkpoint
from rebm.data.pipeline import DataError, load_indist
from rebm.models import build_model
from rebm.standin.writers import write_fake_cifar10
from tests.helpers import make_cfg, run_command

pytestmark = pytest.mark.timeout(120)


class Payload:
    """Unpickling this writes a marker file: proof that code in the file ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _model():
    return build_model("WideResNet10x1", 10)


def test_a_checkpoint_that_would_run_code_is_refused_and_does_not_run(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pth"
    torch.save({"state_dict": _model().state_dict(), "x": Payload(marker)}, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(_model(), str(path))
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "exec" in message
    assert "model.trust_checkpoint=true" in message
    assert not marker.exists()


def test_the_evaluate_entry_refuses_it_in_one_line(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pth"
    torch.save({"state_dict": _model().state_dict(), "x": Payload(marker)}, path)
    result = run_command([sys.executable, "-m", "rebm.eval.evaluate",
                          "experiments/quickstart/digits.yaml", f"model.ckpt_path={path}",
                          "model.model_type=WideResNet10x1"], timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    assert "model.trust_checkpoint=true" in result.output and "Traceback" not in result.output
    assert not marker.exists()


def test_objects_real_checkpoints_hold_load_without_trust(tmp_path):
    """The original code's and public robust models' files: run arguments as an argparse
    namespace, numpy scalars and arrays next to the weights."""
    path = tmp_path / "original.pt"
    model = _model()
    torch.save({"model": model.state_dict(), "args": argparse.Namespace(lr=0.1, arch="wrn"),
                "epoch": np.int64(300), "best_acc": np.float64(0.61),
                "history": np.arange(4, dtype=np.float32)}, path)
    state = read_checkpoint(str(path))
    assert state["args"].lr == 0.1 and int(state["epoch"]) == 300
    report = load_checkpoint(_model(), str(path))
    assert report.layout == "['model']"


def test_trusting_a_file_loads_other_objects(tmp_path):
    from fractions import Fraction

    path = tmp_path / "custom.pt"
    torch.save({"state_dict": _model().state_dict(), "ratio": Fraction(1, 3)}, path)
    with pytest.raises(CheckpointError, match="fractions.Fraction"):
        read_checkpoint(str(path))
    assert read_checkpoint(str(path), trust=True)["ratio"] == Fraction(1, 3)


def test_a_cifar_batch_that_would_run_code_is_refused(tmp_path):
    folder = write_fake_cifar10(str(tmp_path), n_train=10, n_test=5)
    marker = tmp_path / "ran"
    bad = os.path.join(folder, "data_batch_1")
    with open(bad, "wb") as fh:
        pickle.dump({"data": Payload(marker)}, fh)
    with pytest.raises(DataError) as err:
        load_indist(make_cfg(str(tmp_path)).data, "train")
    assert bad in str(err.value) and "exec" in str(err.value)
    assert not marker.exists()
