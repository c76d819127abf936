"""A rank killed (SIGKILL) or stopped (SIGSTOP) under torchrun, in training, evaluation and the
table: the job ends with one line naming the rank, within a bound the settings give, instead of
the backend's traceback or a silent wait (rebm/distributed/collectives.py `name_missing_ranks`)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.helpers import (
    CONFIG,
    FAST,
    NO_ATTACKS,
    REPO,
    base_env,
    error_lines,
    finish,
    process_alive,
    rebm_traceback_lines,
    start_torchrun,
    torchrun_cmd,
    wait_for_records,
    wait_for_workers,
)
from tests.processes import popen

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

STEPS = [CONFIG, *FAST, *NO_ATTACKS, "robust_eval=false", "n_imgs_per_metrics_log=32",
         "max_steps=100000", "total_epochs=null", "n_imgs_per_ckpt_save=100000",
         "model.compile=false"]
# What gloo prints when its peer is gone; none of it may reach the console.
GLOO_NOISE = re.compile(r"Connection (reset|closed) by peer|Timed out waiting|enforce fail")




def _wait_for(predicate, agent, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        assert agent.poll() is None, agent.communicate()[0][-4000:]
        time.sleep(0.2)
    pytest.fail("the job did not get there")


def _end(agent, pids: dict, victim: int, sig: int, until_gone: int, limit: float) -> tuple:
    """Send `sig` to rank `victim`, wait (at most `limit` s) until rank `until_gone` has exited,
    then end what is left; (seconds until it exited, exit code, output)."""
    try:
        os.kill(pids[victim], sig)
        sent = time.time()
        while process_alive(pids[until_gone]) and time.time() < sent + limit:
            time.sleep(0.2)
        took = time.time() - sent
        # a stopped rank cannot act on torchrun's SIGTERM; its SIGKILL comes 30 s later: sooner
        if process_alive(pids[victim]):
            os.kill(pids[victim], signal.SIGKILL)
        code, output = finish(agent, timeout=90)
    finally:
        for pid in pids.values():
            if process_alive(pid):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    return took, code, output


def _one_line(output: str, pattern: str) -> str:
    """The job's one error line, matching `pattern`; no traceback of rebm, no gloo text."""
    errors = error_lines(output)
    assert len(errors) == 1, output[-5000:]
    assert re.search(pattern, errors[0]), errors[0]
    assert rebm_traceback_lines(output) == [], output[-5000:]
    assert not GLOO_NOISE.search(output), output[-5000:]
    return errors[0]


def test_a_killed_rank_is_named_in_one_line_during_training(tmp_path):
    run_dir = tmp_path / "run"
    agent = start_torchrun(STEPS, run_dir)
    pids = wait_for_workers(agent)
    wait_for_records(run_dir, 2, agent)
    took, code, output = _end(agent, pids, 1, signal.SIGKILL, until_gone=0, limit=60)
    assert code != 0
    _one_line(output, r"^\[rank 0\] error: lost the connection to another rank at step \d+ on "
                      r"rank 0: rank 1 ended \(killed")
    assert took < 10 + 25, took  # the 10 s roll call, then the exit (slow on a busy machine)


def test_a_rank_stopped_before_the_first_step_is_named_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    agent = start_torchrun([*STEPS, "ddp_timeout_s=10"], run_dir)
    pids = wait_for_workers(agent)
    # the ranks have joined (each opened its log file, a collective) and not yet stepped
    _wait_for(lambda: (run_dir / "logs" / "rank1.log").exists(), agent)
    took, code, output = _end(agent, pids, 1, signal.SIGSTOP, until_gone=0, limit=90)
    assert code != 0
    _one_line(output, r"^\[rank 0\] error: collective timed out (at step 1 )?on rank 0: rank 1 "
                      r"did not arrive .*ddp_timeout_s")
    assert not (run_dir / "metrics.jsonl").exists(), "the fault came after a step"
    assert took < 10 + 10 + 25, took


# --------------------------------------------------------------------------------------------
# rebm.eval.evaluate under torchrun
# --------------------------------------------------------------------------------------------
STAGE2 = "experiments/quickstart/digits_stage2.yaml"


def _checkpoint(path: Path) -> Path:
    import torch

    from rebm.config import load_config
    from rebm.models import model_from_config

    torch.manual_seed(0)
    cfg = load_config(STAGE2, ["model.ckpt_path=null"])
    torch.save(model_from_config(cfg.model, cfg.data).state_dict(), path)
    return path


def _start_evaluation(tmp_path: Path, *extra: str):
    """A 2-rank evaluation long enough to be interrupted, and the file its output goes to."""
    ckpt = _checkpoint(tmp_path / "model.pth")
    log = tmp_path / "console.txt"
    cmd = torchrun_cmd("rebm.eval.evaluate", [
        STAGE2, f"model.ckpt_path={ckpt}", f"run_dir={tmp_path / 'out'}", "data.num_workers=0",
        "robust_eval_steps=20", "--no-ece", *extra], 2)
    agent = popen(cmd, base_env(), REPO, output=str(log))
    return agent, log


def _evaluating(log: Path) -> bool:
    return log.exists() and "eval.json will be written to" in log.read_text(errors="replace")


def test_a_killed_rank_is_named_in_one_line_during_evaluate(tmp_path):
    agent, log = _start_evaluation(tmp_path)
    pids = wait_for_workers(agent)
    _wait_for(lambda: _evaluating(log), agent)
    took, code, _ = _end(agent, pids, 1, signal.SIGKILL, until_gone=0, limit=60)
    output = log.read_text(errors="replace")
    assert code != 0
    _one_line(output, r"^\[rank 0\] error: lost the connection to another rank in the "
                      r"evaluation on rank 0: rank 1 ended \(killed")
    assert not (tmp_path / "out" / "eval.json").exists()
    assert took < 10 + 25, took


def test_a_stopped_rank_is_named_in_one_line_during_evaluate(tmp_path):
    agent, log = _start_evaluation(tmp_path, "ddp_timeout_s=10")
    pids = wait_for_workers(agent)
    _wait_for(lambda: _evaluating(log), agent)
    took, code, _ = _end(agent, pids, 1, signal.SIGSTOP, until_gone=0, limit=90)
    output = log.read_text(errors="replace")
    assert code != 0
    _one_line(output, r"^\[rank 0\] error: collective timed out in the evaluation on rank 0: "
                      r"rank 1 did not arrive .*ddp_timeout_s \(now 10 s\)")
    assert took < 10 + 10 + 25, took


# --------------------------------------------------------------------------------------------
# rebm.eval.table under torchrun: its own timeout, --ddp-timeout-s
# --------------------------------------------------------------------------------------------
def test_a_stopped_rank_is_named_by_the_table_within_its_timeout(tmp_path):
    import json

    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    _checkpoint(ckpts / "a.pth")
    table = tmp_path / "t.yaml"
    table.write_text(json.dumps({  # JSON is YAML
        "title": "t", "metrics": ["accuracy", "robust_accuracy"], "batch_size": 8,
        "overrides": ["data.num_workers=0", "robust_eval_steps=20"],
        "rows": [{"name": "a", "group": "G", "seed": 0, "config": str(REPO / STAGE2),
                  "checkpoint": "a.pth"}]}))
    out = tmp_path / "out"
    log = tmp_path / "console.txt"
    cmd = torchrun_cmd("rebm.eval.table", [str(table), "--checkpoints", str(ckpts), "--out",
                                           str(out), "--ddp-timeout-s", "10"], 2)
    agent = popen(cmd, base_env(), REPO, output=str(log))
    pids = wait_for_workers(agent)
    _wait_for(lambda: (out / "logs" / "rank1.log").exists(), agent)
    took, code, _ = _end(agent, pids, 1, signal.SIGSTOP, until_gone=0, limit=90)
    output = log.read_text(errors="replace")
    assert code != 0
    _one_line(output, r"^\[rank 0\] error: collective timed out in the table on rank 0: rank 1 "
                      r"did not arrive .*--ddp-timeout-s \(now 10 s\)")
    assert took < 10 + 10 + 25, took  # not gloo's 1800 s


# --------------------------------------------------------------------------------------------
# A stall inside training's evaluation: named as the evaluation at its step, with the timeout
# in force there (rebm/engine/saving.py `patient_collectives`)
# --------------------------------------------------------------------------------------------
def _stalled_evaluation_all_ranks(out: str) -> None:
    """Rank 1 does not reach the evaluation's all-reduce in time; each rank writes what it
    raised to out/rank<r>.txt."""
    import torch

    from rebm.config.sections import DistributedSection
    from rebm.distributed import all_reduce_sum, setup_distributed, teardown
    from rebm.engine.parts import Progress
    from rebm.engine.saving import patient_collectives

    runtime = setup_distributed(timeout_s=60)
    distributed = DistributedSection(ddp_timeout_s=4, ddp_step_timeout_s=2)
    progress = Progress(step=7, steps_run=7)
    said = "no error"
    try:
        if runtime.rank == 1:
            time.sleep(25)
        with patient_collectives(runtime, distributed, progress):
            all_reduce_sum(runtime, torch.ones(3))
    except Exception as err:  # the line under test; rank 1's own is whatever gloo says
        said = f"{type(err).__name__}: {err}"
    Path(out, f"rank{runtime.rank}.txt").write_text(said)
    if runtime.rank == 0:
        teardown(runtime)


def test_a_stall_in_trainings_evaluation_names_the_evaluation_and_its_timeout(tmp_path):
    from rebm.distributed.torch_versions import unsettable_timeout
    from tests.processes import spawn_ranks

    if unsettable_timeout("gloo") is not None:
        pytest.skip("torch < 2.9: gloo keeps its start-up timeout")
    started = time.time()
    spawn_ranks(_stalled_evaluation_all_ranks, 2, str(tmp_path))
    said = (tmp_path / "rank0.txt").read_text()
    assert said.startswith("CollectiveTimeout: collective timed out in the evaluation at step 7 "
                           "on rank 0: rank 1 did not arrive"), said
    assert said.endswith("It waits 4 s, the larger of ddp_timeout_s and ddp_step_timeout_s: "
                         "raise ddp_timeout_s if it is legitimately slower."), said
    assert "\n" not in said
    assert time.time() - started < 60
