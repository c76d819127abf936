"""What `python -m rebm.eval.table` says (issue 29): `--force` names what it recomputes, and a
`--force` run that was killed is named on the rerun, which recomputes what it had not reached;
a mistyped key in a table's overrides is blamed on the table file and its row, with the closest
key; a mistyped metric name gets the closest name (tables and `rebm.eval.evaluate` alike);
overrides of a metric the table does not run are one notice; the log lists the metrics in the
order they run, and the legend does not call a baseline row published.

The console output is captured from the real entry points, in process where the run can finish
there (`main([...])`), as a subprocess for the run that is killed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import run_command
from tests.test_table import _kill_after
from tests.test_table_cache import STAGE2, STANDIN, _env, _table, _write_checkpoint, _write_stats


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("messages")
    ckpts = tmp / "ckpts"
    _write_checkpoint(ckpts / "a.pth", seed=0)
    _write_stats(tmp / "stats.npz", seed=0)
    return tmp, ckpts


def _main(capsys, *argv: str):
    """(exit code, stderr) of the real entry function, in process."""
    from rebm.eval.commands.table import main

    try:
        code = main(list(argv))
    except SystemExit as stop:
        code = stop.code
    return (0 if code is None else code), capsys.readouterr().err


def _lines(err: str, text: str) -> list:
    return [line for line in err.splitlines() if text in line]


def test_force_names_what_it_recomputes_and_a_killed_force_is_named_on_the_rerun(
        tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("REBM_FID_FEATURES", STANDIN)
    tmp, ckpts = tiny
    out = tmp_path / "out"
    # listed out of registry order, and FID slow enough (many steps) to be killed during it
    table = _table(tmp, "force", ["fid", "accuracy"], ["a"],
                   metric_overrides={"fid": ["image_log.num_steps=400"]})
    args = [str(table), "--checkpoints", str(ckpts), "--out", str(out)]
    code, err = _main(capsys, *args)
    assert code == 0 and "Traceback" not in err, err
    assert _lines(err, "[1/1] a: 0 of 2 metrics already computed; computing accuracy, fid")

    killed = _kill_after([sys.executable, "-m", "rebm.eval.table", *args, "--force"],
                         "a: accuracy done", 200)
    assert "[1/1] a: --force: recomputing accuracy, fid (2 of them had a cached value)" in killed
    assert "fid done" not in killed
    cache = json.loads((out / "rows" / "a.json").read_text())
    assert cache["force"]["metrics"] == ["fid"]

    code, err = _main(capsys, *args)
    assert code == 0 and "Traceback" not in err, err
    stale = _lines(err, "a --force run started")
    assert len(stale) == 1 and stale[0].endswith(
        "stopped before recomputing fid; their cached values predate it, so they are computed "
        "again"), err
    assert _lines(err, "[1/1] a: 1 of 2 metrics already computed; computing fid")
    assert "force" not in json.loads((out / "rows" / "a.json").read_text())
    code, err = _main(capsys, *args)
    assert code == 0 and _lines(err, "[1/1] a: 2 of 2 metrics already computed") and \
        "--force" not in err


@pytest.mark.parametrize("where, expected", [
    ("table", "{path}: overrides (row a): unknown config key 'image_log.num_sample'. Did you "
              "mean 'image_log.num_samples'?"),
    ("row", "{path}: rows[0] (a).overrides: unknown config key 'image_log.num_sample'. Did you "
            "mean 'image_log.num_samples'?"),
    ("metric", "{path}: metric_overrides.accuracy (row a): unknown config key "
               "'image_log.num_sample'. Did you mean 'image_log.num_samples'?"),
])
def test_a_mistyped_key_in_a_table_is_named_with_its_file_and_row(tmp_path, capsys, where,
                                                                  expected):
    typo = ["image_log.num_sample=5"]
    text = {"metrics": ["accuracy"], "overrides": typo if where == "table" else [],
            "metric_overrides": {"accuracy": typo} if where == "metric" else {},
            "rows": [{"name": "a", "config": STAGE2, "checkpoint": "a.pth",
                      "overrides": typo if where == "row" else []}]}
    path = tmp_path / "t.yaml"
    path.write_text(json.dumps(text))
    code, err = _main(capsys, str(path), "--checkpoints", str(tmp_path), "--check")
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        "error: " + expected.format(path=path) + " (see docs/configs.md for every field)"]
    assert "command line" not in err


@pytest.mark.parametrize("text, argv, expected", [
    ({"metrics": ["accuracy", "autoatack"]}, [],
     "{path}: metrics: unknown metric 'autoatack'; the metrics are accuracy,"),
    ({"metrics": ["accuracy", "fid"]}, ["--metrics", "fdi"],
     "{path}: --metrics 'fdi' is not a metric of this table; its metrics: accuracy, fid. Did "
     "you mean 'fid'?"),
    ({"metrics": ["accuracy"], "metric_overrides": {"autoatack": ["eval.num_images=8"]}}, [],
     "{path}: metric_overrides names 'autoatack', which is no metric. Did you mean "
     "'autoattack'? The table's metrics: accuracy"),
])
def test_a_mistyped_metric_name_in_a_table_gets_the_closest_name(tmp_path, capsys, text, argv,
                                                                 expected):
    path = tmp_path / "t.yaml"
    path.write_text(json.dumps({**text, "rows": [{"name": "a", "config": STAGE2,
                                                  "checkpoint": "a.pth"}]}))
    code, err = _main(capsys, str(path), "--checkpoints", str(tmp_path), "--check", *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: " + expected.format(path=path))
    if "autoatack" in expected:
        assert "Did you mean 'autoattack'?" in lines[0]


@pytest.mark.parametrize("flags", [["--metrics", "autoatack"], ["eval.metrics=[autoatack]"]])
def test_a_mistyped_metric_of_evaluate_gets_the_closest_name(tiny, flags):
    tmp, ckpts = tiny
    result = run_command([sys.executable, "-m", "rebm.eval.evaluate", STAGE2,
                          f"model.ckpt_path={ckpts / 'a.pth'}", f"data.indist_ds_dir={tmp}",
                          *flags], timeout=120, env=_env())
    assert result.returncode == 2 and "Traceback" not in result.output, result.output
    error = _lines(result.output, "unknown metric 'autoatack'")
    assert len(error) == 1 and error[0].endswith("Did you mean 'autoattack'?"), result.output


def test_overrides_of_a_metric_not_run_are_one_notice(tiny, tmp_path, capsys):
    tmp, ckpts = tiny
    table = _table(tmp, "notice", ["accuracy"], ["a"],
                   metric_overrides={"autoattack": ["eval.num_images=8"]})
    code, err = _main(capsys, str(table), "--checkpoints", str(ckpts), "--out",
                      str(tmp_path / "out"), "--check")
    assert code == 0 and "Traceback" not in err, err
    assert _lines(err, "note:") == [f"note: {table}: metric_overrides.autoattack is not used: "
                                    "'autoattack' is not in the table's metrics"]


def test_the_legend_calls_a_baseline_row_a_baseline_not_published(tiny, tmp_path):
    from rebm.eval.table.report import write_report
    from rebm.eval.table.spec import load_table

    tmp, _ = tiny
    table = _table(tmp, "legend", ["accuracy"], ["a"])
    text = json.loads(Path(table).read_text())
    text["rows"][0]["baseline"] = True
    table.write_text(json.dumps(text))
    md, _ = write_report(load_table(str(table)), {"a": {"test_acc": 0.5}}, {}, str(tmp_path))
    markdown = Path(md).read_text()
    assert "| a † | 1 | 0.5000 |" in markdown
    assert "† baseline row (`baseline: true`: evaluated here, not trained by this table)" in \
        markdown and "published" not in markdown
