"""table.md and table.csv of a paper table: one line per seed group, mean ± std over its rows.

The standard deviation is the sample standard deviation (ddof = 1) over the rows of a group
that have the value; a group of one row shows its value alone. A cell whose value only some of
the group's rows have (a metric added to the table, then `--rows` run on some rows) says how
many: '0.8512 (1 of 2 rows)' in table.md, `<key>_n` in table.csv. Both files are written through
a temporary file and a rename. Columns are the table's
`columns` (result key -> header) or, without them, every numeric result key except counts
(`n_*`) and sweep details, in the order the metrics report them. A value computed with another
network than the verified Inception (`fid_unverified`, `fid_standin`, ...) never fills the
column of the verified one: it gets its own column beside it, its header marked.
"""

from __future__ import annotations

import csv
import io
import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from rebm.eval.features.network import marked_keys
from rebm.eval.files import write_text_replacing
from rebm.eval.table.spec import RowSpec, TableSpec

Values = Dict[str, Dict[str, float]]  # row name -> {result key: value}


def number(value) -> Optional[float]:
    """A cached result as a number: ints and floats, and the "inf" / "-inf" strings that JSON
    stores infinities as (rebm.eval.results.jsonable); None for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return float(value) if value in ("inf", "-inf") else None


def default_columns(values: Values, rows: Sequence[RowSpec]) -> Dict[str, str]:
    columns: Dict[str, str] = {}
    for row in rows:
        for key, value in values.get(row.name, {}).items():
            if key.startswith("n_") or "sweep" in key or "best_steps" in key:
                continue
            if number(value) is not None:
                columns.setdefault(key, key)
    return columns


def with_marked_columns(columns: Dict[str, str], values: Values) -> Dict[str, str]:
    """`columns` and, right after a column, the columns of its values by an unverified or
    stand-in network when some row has them (header: the column's, marked)."""
    found = {key for row in values.values() for key in row}
    out: Dict[str, str] = {}
    for key, header in columns.items():
        out[key] = header
        for marked, mark in marked_keys(key).items():
            if marked in found and marked not in columns:
                out[marked] = f"{header} ({mark})"
    return out


def group_stats(values: Values, rows: Sequence[RowSpec], key: str
                ) -> Tuple[Optional[float], Optional[float], int]:
    """(mean, sample std or None, number of values) of `key` over `rows`."""
    found = [number(values.get(r.name, {}).get(key)) for r in rows]
    found = [v for v in found if v is not None]
    if not found:
        return None, None, 0
    std = float(np.std(found, ddof=1)) if len(found) > 1 else None
    return float(np.mean(found)), std, len(found)


def cell(mean: Optional[float], std: Optional[float], count: int = 0, rows: int = 0) -> str:
    """'0.8512 ± 0.0031', '12.35 ± 0.41' (2 decimals from 10 on), '–' without a value; a
    value of fewer rows than the group's says so: '0.8512 (1 of 2 rows)'."""
    if mean is None:
        return "–"
    fewer = f" ({count} of {rows} rows)" if 0 < count < rows else ""
    if not math.isfinite(mean):
        return str(mean) + fewer
    digits = 2 if abs(mean) >= 10 else 4
    return f"{mean:.{digits}f}" + ("" if std is None else f" ± {std:.{digits}f}") + fewer


def groups_of(rows: Sequence[RowSpec]) -> Dict[str, List[RowSpec]]:
    groups: Dict[str, List[RowSpec]] = {}
    for row in rows:
        groups.setdefault(row.group, []).append(row)
    return groups


def write_report(spec: TableSpec, values: Values, missing: Dict[str, str], out_dir: str
                 ) -> Tuple[str, str]:
    """Write <out_dir>/table.md and table.csv; returns their paths. `missing`: row name ->
    the checkpoint path that was not there."""
    present = [r for r in spec.rows if r.name in values]
    columns = with_marked_columns(spec.columns or default_columns(values, present),
                                  {r.name: values[r.name] for r in present})
    groups = groups_of(present)
    md_path, csv_path = os.path.join(out_dir, "table.md"), os.path.join(out_dir, "table.csv")
    write_text_replacing(csv_path, _csv(values, columns, groups))
    write_text_replacing(md_path, _markdown(spec, values, missing, columns, groups))
    return md_path, csv_path


def _csv(values: Values, columns: Dict[str, str], groups: Dict[str, List[RowSpec]]) -> str:
    """table.csv: per group its row count, then per column the mean, the std and how many
    rows have the value (`<key>_n`, which may be fewer than `rows`)."""
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["group", "rows"] + [f"{k}_{s}" for k in columns
                                         for s in ("mean", "std", "n")])
    for group, rows in groups.items():
        line: List[object] = [group, len(rows)]
        for key in columns:
            mean, std, count = group_stats(values, rows, key)
            line += ["" if mean is None else repr(mean), "" if std is None else repr(std), count]
        writer.writerow(line)
    return text.getvalue()


def _markdown(spec: TableSpec, values: Values, missing: Dict[str, str], columns: Dict[str, str],
              groups: Dict[str, List[RowSpec]]) -> str:
    lines = [f"# {spec.title}", "", f"Table file: `{spec.path}`. Cells are mean ± sample "
             "standard deviation (ddof = 1) over the rows (seeds) of a group; one row: its "
             "value; \"(k of n rows)\": only k of the group's n rows have the value yet. "
             "† baseline row (`baseline: true`: evaluated here, not trained by this table).",
             ""]
    lines.append("| model | seeds | " + " | ".join(columns.values()) + " |")
    lines.append("|---|---|" + "---|" * len(columns))
    for group, rows in groups.items():
        mark = " †" if all(r.baseline for r in rows) else ""
        cells = [cell(*group_stats(values, rows, key), len(rows)) for key in columns]
        seeds = ", ".join(str(r.seed) for r in rows if r.seed is not None) or str(len(rows))
        lines.append(f"| {group}{mark} | {seeds} | " + " | ".join(cells) + " |")
    lines += ["", "## Rows", "", "| row | group | seed | " + " | ".join(columns.values()) + " |",
              "|---|---|---|" + "---|" * len(columns)]
    for rows in groups.values():
        for row in rows:
            cells = [cell(number(values[row.name].get(key)), None) for key in columns]
            lines.append(f"| {row.name} | {row.group} | "
                         f"{'' if row.seed is None else row.seed} | " + " | ".join(cells) + " |")
    if missing:
        lines += ["", "## Missing checkpoints", ""]
        lines += [f"- {name}: expected `{path}`" for name, path in missing.items()]
    return "\n".join(lines) + "\n"
