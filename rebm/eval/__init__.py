"""Evaluation: registered metrics (registry.py) over the test set and over generated samples —
accuracy, robust accuracy, AutoAttack, calibration, OOD AUROC, FID, Inception Score,
precision/recall, sample files — run by one `evaluator.Evaluator` per run.

Every function that takes a `runtime` is called by *every* rank: each rank works on its shard
(chunks of one evaluation batch, chunk k on rank k % W — no padding duplicates) and the results
are combined by collectives, so the numbers equal those of a single process. Models passed in are the unwrapped modules.

Entry point: `python -m rebm.eval.evaluate CONFIG model.ckpt_path=PATH` (see evaluate.py).
Submodules are imported on use, so `import rebm.eval` stays light.
"""

__all__ = [
    "accuracy",
    "auc",
    "autoattack",
    "calibration",
    "counterfactuals",
    "evaluate",
    "evaluator",
    "fid",
    "fid_metric",
    "fid_stats",
    "fidelity",
    "generation",
    "inception_score",
    "metric",
    "ood",
    "ood_metric",
    "precision_recall",
    "registry",
    "report",
    "sample_files",
    "samples",
    "sweep",
    "table",
    "table_cache",
    "table_report",
    "table_spec",
    "test_set",
]
