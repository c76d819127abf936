"""Entry points: `python -m rebm.training.train` (DAT, stage 2) and the names DAT scripts import
(rebm.training.modeling)."""
