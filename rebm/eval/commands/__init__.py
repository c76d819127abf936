"""The evaluation's commands, in one place; each is run by its documented path (a module of two
lines beside rebm/eval's packages, listed in docs/evaluation.md):

- evaluate.py     `python -m rebm.eval.evaluate`: one checkpoint, every metric asked for;
- fid_stats.py    `python -m rebm.eval.fid_stats`: FID reference statistics of a dataset;
- class_stats.py  `python -m rebm.eval.counterfactuals`: the per-class statistics of the
                  counterfactual FID;
- table.py        `python -m rebm.eval.table`: a paper table, row by row, cached.
"""
