"""Many steps of stage 2 follow the original DAT code (github:xuwangyin/DAT at fb2ffc7): the
same 50 steps from the same weights and batches (benchmarks/original/common.py TRAJECTORY:
WideResNet-16-4, 32 px, batch 4, T from 0 to a cap of 3 moved by the AUC curriculum, K = 2,
SGD, EMA on), compared step by step (T exactly; AUCs and losses) and at the end (weights and
EMA weights).

- `test_rebm_follows_the_original`: with a checkout of the original (REBM_ORIGINAL=PATH, and
  REBM_ORIGINAL_PYTHONPATH for its dependencies when this environment lacks them), both codes
  run here, in their own processes, through the harness (`python -m benchmarks.original_vs_rebm
  trajectory`); skipped otherwise, with the reason.
- `test_rebm_matches_the_stored_original_run`: the twin that runs in CI without the original:
  rebm alone against tests/data/original_trajectory.json, the ORIGINAL's run written by

      python -m benchmarks.original_vs_rebm --original PATH trajectory \\
          --write-reference tests/data/original_trajectory.json

  on the machine named in the file ("machine"), with the spreads and tolerances beside the
  numbers (docs/design.md §7): "spread_rebm_1_vs_2_threads" (two rebm runs that differ only in
  thread count, compared as the twin compares), "spread_forced_dispatch" (rebm against rebm
  run under `make test-dispatch`'s forced dispatch) and "spread_channels_last_vs_nchw" (rebm's
  CPU default, channels_last weights, against rebm with NCHW weights as the original's: the
  layout rounds convolutions differently and flips single ReLU signs, docs/design.md §7); each
  tolerance is 10x the largest spread (floor 1e-6), an AUC's the larger of its spread and 1/B^2 (one pair of the
  B x B reordered; benchmarks/original/trajectory.py `tolerances`), and T is compared exactly.
  "twin_here_native_dispatch" is what this test measured on that machine. A change to the
  method (loss, attacks, curriculum, optimizer, EMA) moves these numbers far past them.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from benchmarks.original import common, trajectory

pytestmark = [pytest.mark.numbers, pytest.mark.slow, pytest.mark.timeout(900)]

REFERENCE = os.path.join(os.path.dirname(__file__), "data", "original_trajectory.json")
ORIGINAL = os.environ.get("REBM_ORIGINAL")
ORIGINAL_PYTHONPATH = os.environ.get("REBM_ORIGINAL_PYTHONPATH")

def _rebm_run(workdir: str, spec: dict) -> tuple:
    job = common.Job(spec=spec, workdir=workdir, threads=1)
    trajectory.prepare(job)
    result = trajectory.run_rebm(job)
    return result, torch.load(result["final_weights"])


def test_rebm_matches_the_stored_original_run(tmp_path):
    with open(REFERENCE) as fh:
        reference = json.load(fh)
    result, weights = _rebm_run(str(tmp_path), reference["spec"])
    differences = trajectory.twin_differences(reference["steps"], reference["final"],
                                              result["steps"], weights)
    assert trajectory.trajectory_T(result["steps"]) == trajectory.trajectory_T(reference["steps"])
    assert trajectory.T_changes(result["steps"]), "the curriculum must move T within the run"
    failures = trajectory.check(differences, reference["tolerance"])
    assert not failures, f"{failures} (machine of the reference: {reference['machine']})"


@pytest.mark.skipif(not ORIGINAL, reason="no checkout of the original DAT code: set "
                    "REBM_ORIGINAL=PATH (github:xuwangyin/DAT at fb2ffc7)")
def test_rebm_follows_the_original(tmp_path):
    with open(REFERENCE) as fh:
        spec = json.load(fh)["spec"]
    job = common.Job(spec=spec, workdir=str(tmp_path), threads=1)
    trajectory.prepare(job)
    original = trajectory.run_original(job, ORIGINAL, ORIGINAL_PYTHONPATH)
    runs = {t: trajectory.run_rebm(common.Job(**{**job.__dict__, "threads": t})) for t in (1, 2)}
    runs["nchw"] = trajectory.run_rebm(job, "rebm_nchw", variant="eager_nchw")
    w = {t: torch.load(r["final_weights"]) for t, r in runs.items()}
    spread = {**trajectory.step_differences(runs[1]["steps"], runs[2]["steps"]),
              **trajectory.weight_differences(w[1], w[2])}
    spread_nchw = {**trajectory.step_differences(runs[1]["steps"], runs["nchw"]["steps"]),
                   **trajectory.weight_differences(w[1], w["nchw"])}
    tolerance = trajectory.tolerances([spread, spread_nchw], spec["batch_size"])
    agreement = {**trajectory.step_differences(original["steps"], runs[1]["steps"]),
                 **trajectory.weight_differences(torch.load(original["final_weights"]), w[1])}
    assert trajectory.T_changes(original["steps"]), "the curriculum must move T within the run"
    failures = trajectory.check(agreement, tolerance)
    assert not failures, (f"{failures}; spread between 1 and 2 threads: {spread}, between "
                          f"channels_last and NCHW: {spread_nchw}")
