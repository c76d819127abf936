"""What each whole run reached (run_twin's records), and the distributions of the sides compared:
per quantity, each side's mean and standard deviation over its seeds, Welch's two-sample t-test
between two sides, and the smallest difference that many seeds would detect (two-sided 5 %
test, 80 % power, from the two sides' spreads)."""

from __future__ import annotations

import math
from typing import Dict, List

import numpy as np
import torch

from benchmarks.original import run_configs, run_data

AUC_TAIL = 20  # the adversarial AUC of a run: its mean over the last steps


def run_quantities(spec: dict, record: dict, total_steps: int, features, reference) -> dict:
    """The quantities of one run: final accuracies (at the last evaluation both codes make), the
    update at which T first reaches each value, the adversarial AUC, the steps of
    model_bestacc.pth (first strictly higher robust accuracy, the original's rule) and of
    model_bestfid.pth (first strictly lower FID by the shared feature network), the samples'
    statistics at the last evaluation."""
    steps = run_configs.evaluation_steps(spec, total_steps)
    evaluations = {e["step"]: e for e in record["evaluations"]}
    missing = [s for s in steps if s not in evaluations or s not in record["samples"]]
    if missing:
        raise ValueError(f"a run lacks the evaluations of steps {missing}")
    out = {"final_test_acc": evaluations[steps[-1]]["test_acc"],
           "final_robust_acc": evaluations[steps[-1]]["robust_test_acc"]}
    T = record["T"][:total_steps]
    for value in range(1, spec["T_cap"] + 1):
        reached = [i + 1 for i, t in enumerate(T) if t >= value]
        out[f"T_reaches_{value}"] = reached[0] if reached else math.nan
    out["final_T"] = T[-1]
    out["adv_auc_last_steps"] = float(np.mean(record["adv_auc"][:total_steps][-AUC_TAIL:]))
    best, out["bestacc_step"] = -1.0, None
    for step in steps:
        if evaluations[step]["robust_test_acc"] > best:
            best, out["bestacc_step"] = evaluations[step]["robust_test_acc"], step
    fids = {}
    for step in steps:
        fids[step], stats = sample_statistics(record["samples"][step], features, reference)
        if step == steps[-1]:
            out.update(stats)
    best_fid, out["bestfid_step"] = math.inf, None
    for step in steps:
        if fids[step] < best_fid:
            best_fid, out["bestfid_step"] = fids[step], step
    out["best_fid"] = best_fid
    return out


def sample_statistics(path: str, features, reference) -> tuple:
    """(FID against the training digits, {statistics}) of one evaluation's samples."""
    from benchmarks.original.run_twin import load_samples

    images = load_samples(path)
    feats, predicted = features(images)
    labels = torch.arange(len(images)) % 10  # both codes condition sample i on class i mod 10
    fid = run_data.frechet_distance(feats, reference)
    return fid, {"final_fid": fid, "sample_mean": float(images.mean()),
                 "sample_std": float(images.std()),
                 "samples_of_their_class": float((predicted == labels).float().mean())}


def compare(a: List[float], b: List[float], censor_at=None) -> Dict[str, float]:
    """Welch's t-test of two samples, and the difference detectable with their spreads. With
    `censor_at` (the update at which T first reaches a value), a run that never reached it
    counts as reaching it at `censor_at` (after its last update), and p is the Mann-Whitney rank
    test's: the mean over the runs that reached it alone would select the early ones."""
    from scipy import stats

    if censor_at is not None:
        a = [censor_at if math.isnan(v) else v for v in a]
        b = [censor_at if math.isnan(v) else v for v in b]
    x = np.array([v for v in a if not math.isnan(v)], dtype=float)
    y = np.array([v for v in b if not math.isnan(v)], dtype=float)
    if len(x) < 2 or len(y) < 2:
        return {"p": math.nan, "detectable": math.nan}
    se = math.sqrt(x.var(ddof=1) / len(x) + y.var(ddof=1) / len(y))
    if se == 0:
        return {"p": 1.0 if x.mean() == y.mean() else 0.0, "detectable": 0.0}
    p = float(stats.ttest_ind(x, y, equal_var=False).pvalue if censor_at is None
              else stats.mannwhitneyu(x, y, alternative="two-sided").pvalue)
    df = se**4 / ((x.var(ddof=1) / len(x))**2 / (len(x) - 1)
                  + (y.var(ddof=1) / len(y))**2 / (len(y) - 1))
    detectable = (stats.t.ppf(0.975, df) + stats.t.ppf(0.8, df)) * se
    return {"p": p, "detectable": float(detectable)}


def summarize(per_side: Dict[str, List[dict]], total_steps: int,
              pairs=(("original", "rebm1"), ("rebm1", "rebm2"))) -> dict:
    """Per quantity: each side's mean, std, n (runs where it is defined), and each pair's test
    (for T_reaches_*, on the runs censored at total_steps + 1, compare's rank test)."""
    keys = list(next(iter(per_side.values()))[0])
    table = {}
    for key in keys:
        values = {side: [float(r[key]) for r in runs] for side, runs in per_side.items()}
        row = {side: {"mean": _nanstat(np.nanmean, v), "std": _nanstat(_std, v),
                      "n": int(np.sum(~np.isnan(v)))} for side, v in values.items()}
        for a, b in pairs:
            if a in values and b in values:
                censor = total_steps + 1 if key.startswith("T_reaches_") else None
                row[f"{a}_vs_{b}"] = compare(values[a], values[b], censor)
        table[key] = row
    return table


def _std(v):
    return np.nanstd(v, ddof=1)


def _nanstat(fn, values):
    v = np.array(values, dtype=float)
    return float(fn(v)) if np.sum(~np.isnan(v)) > 1 or fn is np.nanmean and np.any(~np.isnan(v)) \
        else math.nan


def format_table(table: dict, sides: List[str]) -> str:
    pairs = [k for k in next(iter(table.values())) if "_vs_" in k]
    head = ("| quantity | " + " | ".join(f"{s} mean ± std (n)" for s in sides) + " | "
            + " | ".join(f"{p.replace('_vs_', ' vs ')}: p (detectable)" for p in pairs) + " |")
    lines = [head, "|" + "---|" * (1 + len(sides) + len(pairs))]
    for key, row in table.items():
        cells = [f"{_g(row[s]['mean'])} ± {_g(row[s]['std'])} ({row[s]['n']})" for s in sides]
        tests = [f"{_g(row[p]['p'], 2)} ({_g(row[p]['detectable'])})" for p in pairs]
        lines.append(f"| {key} | " + " | ".join(cells + tests) + " |")
    return "\n".join(lines)


def _g(value: float, digits: int = 4) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else f"{value:.{digits}g}"
