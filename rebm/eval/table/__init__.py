"""The paper-table runner (`python -m rebm.eval.table`, docs/evaluation.md): the command and its
arguments (command.py), the run over rows and metrics on every rank (runner.py), the table YAML
(spec.py), the per-metric results cache (cache.py), `--check` (check.py), table.md and table.csv
(report.py), and tables from the original's model configs (original_configs.py)."""
