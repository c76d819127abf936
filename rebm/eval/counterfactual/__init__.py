"""The pieces of the counterfactual metric (rebm/eval/metrics/counterfactuals.py): the
attack and settings (attack.py), the original's protocol (original.py), the grid (grid.py) and
the per-class statistics (stats.py; command: python -m rebm.eval.counterfactuals)."""
