"""The sections of benchmarks/bench_train.py, one module each; `common` holds what they share."""
