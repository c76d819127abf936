"""Feature networks and what is computed on their features: pytorch-fid's Inception, the
Fréchet distance, statistics and reference files (fid.py); torch-fidelity's network for the
Inception Score and precision/recall (fidelity.py). The shipped stand-in is rebm/eval/standin.py."""
