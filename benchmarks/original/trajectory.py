"""The trajectory comparison: the same stage-2 steps from the same weights and batches, run by the
original's code and by rebm's, compared step by step (T, AUCs, losses) and at the end (the
weights and the EMA weights); and the stored reference the CI twin compares rebm with.

The reference (tests/data/original_trajectory.json) holds the ORIGINAL's run, summarised so it
stays small: every step's record, the classifier head's weights in full and, per weight tensor,
three sums (plain, absolute, and against a fixed +-1 pattern). Tolerances sit next to the
numbers in the file, with the spreads they were set from.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import torch

from benchmarks.original import common, sides

STEP_KEYS = ("adv_auc", "clean_auc", "ebm_binary_loss", "clf_loss")
HEAD = ("fc.weight", "fc.bias")  # stored in full: the layer the losses reach first


def prepare(job: common.Job, extra_env: Optional[dict] = None) -> None:
    """The shared inputs, written once by rebm's side: the batches and the initial weights
    (rebm's initialisation); `extra_env`: that process's extra environment."""
    os.makedirs(job.workdir, exist_ok=True)
    with sides.start_rebm(job, "rebm_inputs", extra_env) as side:
        side.request("write_inputs")


def run_rebm(job: common.Job, tag: Optional[str] = None, extra_env: Optional[dict] = None,
             variant: str = "eager") -> dict:
    """rebm's run of the job (rebm_adapter.config_overrides `variant`)."""
    tag = tag or f"rebm_{job.threads}threads"
    with sides.start_rebm(job, tag, extra_env) as side:
        result = side.request("trajectory", name=tag, variant=variant)
        result["describe"] = side.request("describe")
    return result


def run_original(job: common.Job, checkout: str, extra_path: Optional[str] = None) -> dict:
    with sides.start_original(job, checkout, extra_path) as side:
        result = side.request("trajectory")
        result["describe"] = side.request("describe")
    return result


def sign_pattern(numel: int) -> torch.Tensor:
    """A fixed +-1 pattern (uniform draws compared with 0.5: the same bits on every machine)."""
    g = torch.Generator().manual_seed(12345)
    return (torch.rand(numel, generator=g, dtype=torch.float64) < 0.5).double() * 2 - 1


def summarize(state: Dict[str, torch.Tensor]) -> dict:
    """Per floating tensor: [sum, sum of |w|, sum of w * pattern] in float64; the head in full."""
    sums, head = {}, {}
    for name, tensor in state.items():
        if not tensor.is_floating_point():
            continue
        flat = tensor.detach().double().flatten()
        sums[name] = [float(flat.sum()), float(flat.abs().sum()),
                      float(flat @ sign_pattern(flat.numel()))]
        if name in HEAD:
            head[name] = flat.tolist()
    return {"sums": sums, "head": head}


def step_differences(a: List[dict], b: List[dict]) -> dict:
    """Largest |a - b| per step quantity; the steps where T differs (it must not)."""
    out = {"T_mismatch_steps": [i for i, (x, y) in enumerate(zip(a, b, strict=True))
                                if x["T"] != y["T"]]}
    for key in STEP_KEYS:
        pairs = [(x[key], y[key]) for x, y in zip(a, b, strict=True) if key in x and key in y]
        out[key] = max((abs(x - y) for x, y in pairs), default=0.0)
    return out


def weight_differences(a: Dict[str, Dict[str, torch.Tensor]],
                       b: Dict[str, Dict[str, torch.Tensor]]) -> Dict[str, float]:
    """Largest element-wise |a - b| over the weights ("model") and the EMA weights ("ema")."""
    return {part: max(float((a[part][k].double() - b[part][k].double()).abs().max())
                      for k in a[part] if a[part][k].is_floating_point())
            for part in ("model", "ema")}


def summary_differences(a: dict, b: dict) -> Dict[str, float]:
    """Largest |a - b| of the summaries: per part, the head's elements and the tensor sums
    (each sum relative to the tensor's sum of |w|, so large and small tensors weigh alike)."""
    out = {}
    for part in ("model", "ema"):
        head = max(abs(x - y) for name in HEAD
                   for x, y in zip(a[part]["head"][name], b[part]["head"][name], strict=True))
        sums = max(abs(x - y) / max(abs(sa[1]), 1e-12)
                   for name, sa in a[part]["sums"].items()
                   for x, y in zip(sa, b[part]["sums"][name], strict=True))
        out[f"{part}_head"], out[f"{part}_sums"] = head, sums
    return out


def twin_differences(reference_steps: list, expected: dict, steps: list,
                     weights: dict) -> dict:
    """What the CI twin compares (tests/test_original_trajectory.py): a rebm run's steps and
    weight summaries against the stored ones."""
    summary = {part: summarize(weights[part]) for part in ("model", "ema")}
    return {**step_differences(reference_steps, steps),
            **summary_differences(expected, summary)}


def trajectory_T(steps: List[dict]) -> List[int]:
    return [s["T"] for s in steps]


def T_changes(steps: List[dict]) -> List[int]:
    """The (0-based) steps whose T differs from the step before's."""
    Ts = trajectory_T(steps)
    return [i for i in range(1, len(Ts)) if Ts[i] != Ts[i - 1]]


AUC_KEYS = ("adv_auc", "clean_auc")
FLOOR = 1e-6  # where a spread is 0: below float32's resolution of the values compared
# The run's environment of `make test-dispatch`: every library below this machine's own kernels
FORCED_DISPATCH = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                   "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}


def tolerances(spreads: List[dict], batch_size: int) -> Dict[str, float]:
    """Per quantity, from the measured spreads (docs/design.md §7): 10x the largest spread
    (floor 1e-6); for an AUC, the larger of its largest spread and 1/B^2. An AUC over B
    positives and B negatives moves in steps of 1/B^2 (one pair ordered the other way); a
    rounding difference can reorder a near-tie pair (measured: one pair at one step under the
    forced dispatch), and what the AUC decides, T, is compared exactly."""
    keys = {k for spread in spreads for k, v in spread.items() if isinstance(v, float)}
    out = {}
    for key in sorted(keys):
        largest = max(spread.get(key, 0.0) for spread in spreads)
        out[key] = (max(largest, 1 / batch_size**2) if key in AUC_KEYS
                    else max(10 * largest, FLOOR))
    return out


def check(differences: Dict[str, object], tolerance: Dict[str, float]) -> List[str]:
    """The quantities outside their tolerance, as lines (empty: all agree)."""
    lines = []
    if differences.get("T_mismatch_steps"):
        lines.append(f"T differs at steps {differences['T_mismatch_steps']}")
    for key, bound in tolerance.items():
        if key in differences and differences[key] > bound:
            lines.append(f"{key}: |difference| {differences[key]:.3g} > tolerance {bound:.3g}")
    return lines
