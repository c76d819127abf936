"""The side-by-side harness against the original DAT code (issue 42): see
benchmarks/original_vs_rebm.py for the command and docs/performance.md "Against the original"."""
