"""The registered metrics (rebm/eval/registry.py), one module each: accuracy and robust
accuracy, AutoAttack, calibration (ECE), OOD detection ("ood", "ood_sets"), counterfactuals, the
sample files, FID, Inception Score, precision/recall. What a metric is: rebm/eval/metric.py."""
