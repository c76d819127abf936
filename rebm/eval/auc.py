"""`binary_auc` under its earlier path, for the OOD metrics' imports; it lives in `rebm/auc.py`."""

from rebm.auc import binary_auc

__all__ = ["binary_auc"]
