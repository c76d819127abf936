"""Failures injected on one rank (tests/faults.py, started as `python -m tests.faulty_train`):
every rank stops together, with one line, and no bad state is written."""

import re

import pytest
import torch

from rebm.distributed.torch_versions import unsettable_timeout
from tests.helpers import CONFIG, FAST, error_lines, load_state, rebm_traceback_lines, run_train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

FAULTY = "tests.faulty_train"


def assert_same_training_state(a, b):
    """Weights, EMA, optimizer and the method's state (DAT's curriculum) bit for bit."""
    for part in ("model", "ema"):
        assert a[part].keys() == b[part].keys()
        for key, value in a[part].items():
            if torch.is_tensor(value):
                assert torch.equal(value, b[part][key]), (part, key)
    opt_a, opt_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert opt_a.keys() == opt_b.keys()
    for index, values in opt_a.items():
        for name, value in values.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_b[index][name]))
    assert a["method"] == b["method"]


@pytest.mark.numbers
def test_nan_gradients_on_one_rank_stop_every_rank_before_they_are_saved(straight, tmp_path):
    """A finite loss with NaN gradients on rank 1 only at step 3: DDP spreads them, the update
    is not applied, both ranks stop at that step, and the newest state is the one before it,
    identical to that of the session's 2-rank run without the fault (tests/conftest.py)."""
    run_dir = tmp_path / "run"
    result = run_train([CONFIG, *FAST, "max_steps=8", "--nan-grad-at=3:1"], nproc=2,
                       run_dir=run_dir, timeout=300, module=FAULTY)
    assert result.returncode != 0, result.output[-4000:]
    errors = [line for line in error_lines(result.output) if "] error:" in line]
    assert errors == [errors[0]] and errors[0].startswith(  # one line per job
        "[rank 0] error: non-finite loss or gradients at step 3"), result.output[-4000:]
    assert not rebm_traceback_lines(result.output)
    states = sorted((run_dir / "checkpoints").glob("state_*.pt"))
    assert states[-1].name == "state_000000002.pt"
    assert_same_training_state(load_state(straight / "ws2", 2), load_state(run_dir, 2))


@pytest.mark.skipif(unsettable_timeout("gloo") is not None,
                    reason="torch < 2.9: gloo keeps its start-up timeout (the run says so)")
def test_a_rank_slower_than_the_step_timeout_is_named(tmp_path):
    """Rank 1 sleeps through step 3 longer than ddp_step_timeout_s: the job ends, naming it.
    Rank 0 names it after the timeout and a 10 s roll call; the job lasts as long as the sleep
    (torchrun's SIGTERM does not cut it short), so the sleep exceeds the timeout by a margin for
    a loaded machine, no more."""
    result = run_train([CONFIG, *FAST, "max_steps=6", "ddp_step_timeout_s=8",
                        "n_imgs_per_ckpt_save=100000", "--slow-step-at=3:1:20"], nproc=2,
                       run_dir=tmp_path / "run", timeout=240, module=FAULTY)
    assert result.returncode != 0
    assert re.search(r"rank 1 did not arrive", result.output), result.output[-4000:]
