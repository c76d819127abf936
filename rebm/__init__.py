"""rebm: robust energy-based models trained by Dual Adversarial Training (DAT)."""

__version__ = "0.1.0"
