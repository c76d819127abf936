"""Evaluation, by concern (docs/design.md, "One evaluation"):

- evaluator.py: the `Evaluator`, one per run, that every entry point evaluates through;
  metric.py (what a metric is), registry.py (the metrics by name), test_set.py (the test
  images and their pass), report.py (values as written and shown);
- metrics/: the registered metrics, one module each;
- sampling/: sample generation, the shared generation pass, FID's step sweep;
- features/: the feature networks (pytorch-fid's Inception, torch-fidelity's) and FID's
  statistics; standin.py, the shipped stand-in for them;
- counterfactual/: the pieces of the counterfactual metric;
- table/: the paper-table runner (`python -m rebm.eval.table`);
- the commands: evaluate.py, fid_stats.py, counterfactuals.py; auc.py, the ROC-AUC that DAT's
  curriculum uses too.

Each rank works on its shard (chunks of one evaluation batch, chunk k on rank k % W — no padding
duplicates) and the results are combined by collectives, so the numbers equal those of a single
process; which functions every rank must call is docs/design.md §3's rule (`_all_ranks`). Models passed in
are the unwrapped modules. Submodules are imported on use, so `import rebm.eval` stays light.
"""

__all__ = [
    "auc",
    "counterfactual",
    "counterfactuals",
    "evaluate",
    "evaluator",
    "features",
    "fid_stats",
    "metric",
    "metrics",
    "registry",
    "report",
    "sampling",
    "standin",
    "table",
    "test_set",
]
