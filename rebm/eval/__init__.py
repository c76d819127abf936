"""Evaluation, by concern (docs/design.md, "One evaluation"); modules import only downwards in
this order (an import-linter contract, pyproject.toml):

- evaluate.py, fid_stats.py, counterfactuals.py (and table/__main__.py): the documented command
  paths, two lines each, over commands/: the commands themselves;
- table/: the paper-table runner;
- evaluator.py: the `Evaluator`, one per run, that every entry point evaluates through;
- results.py (values as written and shown), registry.py (the metrics by name);
- metrics/: the registered metrics, one module (or package: counterfactuals/) each;
- sampling/ (sample generation, the shared generation pass, FID's step sweep) and test_set.py
  (the test images and their pass);
- features/: the feature networks (pytorch-fid's Inception, torch-fidelity's) and FID's
  statistics;
- metric.py (what a metric is), passes.py (eval mode, the chunked loader), exact_sums.py,
  auc.py (the ROC-AUC that DAT's curriculum uses too), standin.py (the shipped stand-in network).

Each rank works on its shard (chunks of one evaluation batch, chunk k on rank k % W — no padding
duplicates) and the results are combined by collectives, so the numbers equal those of a single
process; which functions every rank must call is docs/design.md §3's rule (`_all_ranks`). Models passed in
are the unwrapped modules. Submodules are imported on use, so `import rebm.eval` stays light.
"""

__all__ = [
    "auc",
    "commands",
    "evaluator",
    "exact_sums",
    "features",
    "metric",
    "metrics",
    "passes",
    "registry",
    "results",
    "sampling",
    "standin",
    "table",
    "test_set",
]
