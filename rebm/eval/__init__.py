"""Evaluation: clean/robust accuracy, class-conditional samples, FID, OOD AUROC, calibration.

Every function that takes a `runtime` is called by *every* rank: each rank works on its shard
(indices rank, rank+W, ... — no padding duplicates) and the results are combined by collectives,
so the numbers equal those of a single process. Models passed in are the unwrapped modules.

Entry point: `python -m rebm.eval.evaluate CONFIG model.ckpt_path=PATH` (see evaluate.py).
Submodules are imported on use, so `import rebm.eval` stays light.
"""

__all__ = [
    "accuracy",
    "calibration",
    "auc",
    "evaluate",
    "evaluation",
    "fid",
    "fid_stats",
    "generation",
    "ood",
    "report",
    "sweep",
]
