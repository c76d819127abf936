"""The paper-table runner `python -m rebm.eval.table` end to end, on two tiny checkpoints trained
by the real entry points (the quickstart's stage 1 as the "AT" row, its stage 2 as "DAT" with two
seeds) plus a row whose checkpoint is missing: under 2-process torchrun it writes table.md and
table.csv with every metric; one process, killed in the middle and run again, skips what it
finished and ends with the same table, number for number. Plus the table file's errors."""

from __future__ import annotations

import csv
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from rebm.eval.table.report import cell, group_stats
from rebm.eval.table.spec import RowSpec, TableError, load_table
from rebm.standin.writers import write_fake_svhn
from tests.helpers import BIN, REPO, base_env, finish, rebm_traceback_lines, run_command
from tests.processes import popen

STANDIN = "rebm.eval.standin:features"
STAGE1 = "experiments/quickstart/digits_stage1.yaml"
STAGE2 = "experiments/quickstart/digits_stage2.yaml"
TINY = ["batch_size=32", "max_steps=2", "indist_attack_clf.max_steps=1", "robust_eval_steps=1",
        "n_imgs_per_evaluation_log=null", "image_log.num_samples=10"]
METRICS = ["accuracy", "robust_accuracy", "autoattack", "ece", "ood", "ood_sets",
           "counterfactuals", "sample_grid", "fid", "inception_score", "precision_recall"]
FRACTIONS = ["test_acc", "robust_test_acc", "autoattack_test_acc", "ece", "ood_auroc",
             "ood/noise/auroc", "ood/svhn/adv_fpr95", "ood/mean/adv_auroc",
             "counterfactual_confidence", "counterfactual_success", "precision_standin",
             "recall_standin"]
POSITIVE = ["fid_standin", "inception_score_standin"]  # stand-in features: *_standin keys


def _env():
    return base_env(1, {"REBM_FID_FEATURES": STANDIN, "PYTHONPATH": str(REPO)})


def _table_yaml(tmp: Path) -> Path:
    overrides = ["eval.num_images=40", "data.num_workers=0", "robust_eval_steps=2",
                 "image_log.num_samples=20", "image_log.num_steps=5", "image_log.log_fid=true",
                 f"image_log.data_dir={tmp / 'stats.npz'}", "eval.ood_datasets=[noise,svhn]",
                 "eval.ood_num_samples=16", f"eval.ood_roots.svhn={tmp / 'svhn'}",
                 "eval.ood_attack_steps=2", "eval.counterfactual_num_images=4"]
    rows = [("at", "AT", 0, STAGE1, "stage1/model_final.pth", "baseline: true"),
            ("dat-s0", "DAT", 0, STAGE2, "dat0/model_final.pth", ""),
            ("dat-s1", "DAT", 1, STAGE2, "dat1/model_final.pth", "overrides: [rand_seed=1]"),
            ("dat-s2", "DAT", 2, STAGE2, "dat2/model_final.pth", "")]
    lines = ["title: tiny table", f"metrics: [{', '.join(METRICS)}]", "batch_size: 16",
             "overrides:", *[f"  - '{o}'" for o in overrides],
             "metric_overrides:", "  autoattack: [eval.num_images=8]", "rows:"]
    for name, group, seed, config, ckpt, extra in rows:
        lines += [f"  - name: {name}", f"    group: {group}", f"    seed: {seed}",
                  f"    config: {config}", f"    checkpoint: {ckpt}"]
        lines += [f"    {extra}"] if extra else []
    path = tmp / "table.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(table file, checkpoints folder): stage 1 and two seeds of stage 2, 2 steps each, through
    the real training entry points; FID statistics of a stand-in feature network; an SVHN file."""
    tmp = tmp_path_factory.mktemp("table")
    env = _env()
    run_command([sys.executable, "InNOutRobustnessMean0_cifar100/train_at.py", STAGE1, *TINY,
                 f"run_dir={tmp / 'stage1'}"], timeout=240, env=env).assert_ok()
    for seed in (0, 1):
        run_command([sys.executable, "-m", "rebm.training.train", STAGE2, *TINY,
                     f"model.ckpt_path={tmp / 'stage1' / 'model_final.pth'}", "attack.max_steps=1",
                     f"rand_seed={seed}", f"run_dir={tmp / f'dat{seed}'}"],
                    timeout=240, env=env).assert_ok()
    run_command([sys.executable, "-m", "rebm.eval.fid_stats", STAGE2, "--out",
                 str(tmp / "stats.npz")], timeout=240, env=env).assert_ok()
    write_fake_svhn(str(tmp / "svhn"), 30)
    return _table_yaml(tmp), tmp


def _table_cmd(table: Path, ckpts: Path, out: Path, *extra: str, nproc: int = 1) -> list:
    args = [str(table), "--checkpoints", str(ckpts), "--out", str(out), *extra]
    if nproc == 1:
        return [sys.executable, "-m", "rebm.eval.table", *args]
    return [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", "-m",
            "rebm.eval.table", *args]


def _read_csv(path: Path) -> list:
    with open(path) as fh:
        return list(csv.reader(fh))


def _kill_after(cmd: list, marker: str, timeout: float) -> str:
    """Start cmd, SIGKILL its process group once `marker` appears in its output; the output."""
    log_path = Path(cmd[cmd.index("--out") + 1]).parent / "killed.log"
    log = open(log_path, "w+")
    proc = popen(cmd, _env(), REPO, output=str(log_path))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        log.seek(0)
        if marker in log.read():
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"'{marker}' did not appear within {timeout}s")
    finish(proc, 30)
    log.seek(0)
    return log.read()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_table_on_2_processes_equals_a_killed_and_rerun_single_process(tiny):
    table, ckpts = tiny
    two = ckpts / "out2"
    result = run_command(_table_cmd(table, ckpts, two, nproc=2), timeout=400, env=_env())
    expected = str(ckpts / "dat2" / "model_final.pth")
    assert f"dat-s2: checkpoint missing: expected {expected}" in result.output
    # the table of the other rows is written, and the exit code says a row was skipped
    assert result.returncode != 0
    assert "1 row(s) skipped, checkpoint missing: dat-s2" in result.output
    header, *groups = _read_csv(two / "table.csv")
    assert [g[:2] for g in groups] == [["AT", "1"], ["DAT", "2"]]
    for column in FRACTIONS + POSITIVE:  # every metric has its value in the table
        mean = float(groups[1][header.index(f"{column}_mean")])
        assert 0.0 <= mean <= 1.0 if column in FRACTIONS else mean > 0, column
    markdown = (two / "table.md").read_text()
    assert "| AT † | 0 |" in markdown and "| DAT | 0, 1 |" in markdown
    assert f"- dat-s2: expected `{expected}`" in markdown
    assert (two / "dat-s0" / "counterfactuals" / "per_class.json").is_file()
    assert (two / "at" / "samples" / "gen_samples.png").is_file()

    one = ckpts / "out1"
    killed = _kill_after(_table_cmd(table, ckpts, one), "dat-s0: autoattack done", 400)
    assert "at: fid done" in killed and "table written" not in killed
    rerun = run_command(_table_cmd(table, ckpts, one), timeout=400, env=_env())
    assert rerun.returncode != 0 and "table written" in rerun.output
    assert "[1/4] at: 11 of 11 metrics already computed" in rerun.output
    done = [line for line in rerun.output.splitlines() if "[2/4] dat-s0:" in line][0]
    assert "metrics already computed; computing" in done and "accuracy," not in done
    assert "autoattack" not in done
    # the same numbers as on 2 processes, to the last digit
    assert _read_csv(one / "table.csv") == _read_csv(two / "table.csv")
    assert (one / "table.md").read_text() == markdown

    forced = run_command(_table_cmd(table, ckpts, one, "--rows", "at", "--metrics", "ece",
                                    "--force"), timeout=300, env=_env()).assert_ok()
    assert "[1/1] at: --force: recomputing ece (1 of them had a cached value)" in forced.output
    assert _read_csv(one / "table.csv") == _read_csv(two / "table.csv")


@pytest.mark.slow
def test_a_moved_checkpoint_folder_keeps_the_cache_and_a_changed_checkpoint_does_not(tiny,
                                                                                    tmp_path):
    """The key holds the checkpoint's content, not its path: the same file under another
    --checkpoints folder has the same keys; other bytes of the same size and mtime do not."""
    from rebm.eval.registry import metric_classes
    from rebm.eval.table.cache import FileHashes, metric_key
    from rebm.eval.table.spec import row_sections

    table, ckpts = tiny
    spec = load_table(str(table)).select(["dat-s0"], ["accuracy", "fid"])
    path = ckpts / "dat0" / "model_final.pth"
    moved = tmp_path / "dat0" / "model_final.pth"
    moved.parent.mkdir()
    shutil.copy2(path, moved)

    def keys(root: Path, checkpoint: Path) -> list:
        hashes = FileHashes()
        configs = row_sections(spec, str(root))["dat-s0"]
        return [metric_key(configs[c.name], configs[c.name].model, c,
                           hashes.sha256(str(checkpoint)), spec.batch_size, hashes)
                for c in metric_classes(spec.metrics)]

    assert keys(ckpts, path) == keys(tmp_path, moved)
    stat = moved.stat()
    data = bytearray(moved.read_bytes())
    data[-1] ^= 1
    moved.write_bytes(bytes(data))
    os.utime(moved, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert moved.stat().st_mtime_ns == stat.st_mtime_ns
    changed, same = keys(tmp_path, moved), keys(ckpts, path)
    assert all(a != b for a, b in zip(changed, same, strict=True))


# --------------------------------------------------------------------------------------------
# The table file and the report
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("metrics: [accuracy]\nrows: [{name: a, config: c.yaml}]\n", "rows[0]: 'checkpoint' is missing"),
    ("metrics: [accuracy]\nrows: [{name: a, config: c, checkpoint: x, sed: 1}]\n",
     "rows[0]: unknown key 'sed'"),
    ("metrics: []\nrows: []\n", "metrics must be a non-empty list"),
    ("metrics: [accuracy]\nrows: [{name: a, config: c, checkpoint: x, overrides: [lr]}]\n",
     "'lr' is not a key=value override"),
    ("metrics: [accuracy]\nrows: [{name: a b, config: c, checkpoint: x}]\n", "name 'a b'"),
    ("metrics: [accuracy]\nrows: [{name: a, config: c, checkpoint: x}, "
     "{name: a, config: c, checkpoint: y}]\n", "row name 'a' appears twice"),
    ("metrics: [accuracy]\nmetric_overrides: {fdi: [x=1]}\nrows: [{name: a, config: c, "
     "checkpoint: x}]\n", "metric_overrides names 'fdi', which is no metric. Did you mean 'fid'?"),
    ("metrics: [accuracy\n", "is not valid YAML"),
])
def test_bad_table_files_are_one_line(tmp_path, text, message):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(TableError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        load_table(str(path))
    assert "\n" not in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize("argv, message", [
    (["--rows", "nope"], "--rows 'nope' is neither a row name nor a group"),
    (["--metrics", "fid"], "--metrics 'fid' is not a metric of this table"),
])
def test_entry_point_errors_are_one_line_before_any_work(tmp_path, argv, message):
    path = tmp_path / "t.yaml"
    path.write_text("metrics: [accuracy]\nrows: [{name: a, config: c, checkpoint: x}]\n")
    result = run_command([sys.executable, "-m", "rebm.eval.table", str(path), "--checkpoints",
                          str(tmp_path), *argv], timeout=60, env=_env())
    assert result.returncode == 2
    assert result.output.strip() == f"error: {path}: {message}; " + (
        "rows: a" if "rows" in message else "its metrics: accuracy.")


@pytest.mark.slow
def test_unknown_metric_and_bad_override_name_the_row(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(f"metrics: [accuracy, accuracies]\nrows: [{{name: a, config: {STAGE2}, "
                    "checkpoint: x}]\n")
    cmd = [sys.executable, "-m", "rebm.eval.table", str(path), "--checkpoints", str(tmp_path)]
    result = run_command(cmd, timeout=120, env=_env())
    assert result.returncode == 2 and "unknown metric 'accuracies'" in result.output
    path.write_text(f"metrics: [accuracy]\nrows: [{{name: a, config: {STAGE2}, checkpoint: x, "
                    "overrides: [eval.ood_scor=lse]}]\n")
    result = run_command(cmd, timeout=120, env=_env())
    assert result.returncode == 2 and f"{path}: rows[0] (a).overrides: " in result.output
    assert "unknown config key 'eval.ood_scor'. Did you mean 'eval.ood_score'?" in result.output
    path.write_text(f"metrics: [fid]\nrows: [{{name: a, config: {STAGE2}, checkpoint: x, "
                    f"overrides: [image_log.log_fid=true, image_log.data_dir={tmp_path}/no.npz]}}]\n")
    result = run_command(cmd, timeout=120, env=_env())
    assert result.returncode == 2 and f"row a: image_log.data_dir '{tmp_path}/no.npz'" in result.output
    assert "Traceback" not in result.output


def test_group_statistics_use_the_sample_standard_deviation():
    rows = [RowSpec(name=n, group="g", config="c", checkpoint="x") for n in ("a", "b", "c")]
    values = {"a": {"m": 1.0}, "b": {"m": 2.0}, "c": {"m": 4.0, "only": 0.5}}
    mean, std, n = group_stats(values, rows, "m")
    assert (mean, n) == (7 / 3, 3)
    assert std == pytest.approx(((16 / 9 + 1 / 9 + 25 / 9) / 2) ** 0.5)  # ddof = 1
    assert group_stats(values, rows, "only") == (0.5, None, 1)
    assert cell(*group_stats(values, rows, "m")[:2]) == "2.3333 ± 1.5275"
    assert cell(12.346, 0.5) == "12.35 ± 0.50" and cell(None, None) == "–"
    # an infinite value comes back from the JSON cache as the string "inf": still a number
    infinite = {"a": {"fid": "inf"}, "b": {"fid": 3.0}}
    assert group_stats(infinite, rows[:1], "fid")[0] == float("inf")
    assert cell(*group_stats(infinite, rows[:1], "fid")[:2]) == "inf"


PAPER_TABLES = sorted(p.stem for p in (REPO / "experiments" / "paper").glob("*.yaml"))


@pytest.mark.parametrize("name", PAPER_TABLES)
def test_shipped_paper_tables_load_with_every_row_config(name):
    from rebm.eval.registry import metric_classes
    from rebm.eval.table.spec import row_sections

    spec = load_table(str(REPO / "experiments" / "paper" / f"{name}.yaml"))
    metric_classes(spec.metrics)  # every metric is registered
    configs = row_sections(spec, "/checkpoints")
    for row in spec.rows:
        for metric, cfg in configs[row.name].items():
            assert cfg.model.ckpt_path == f"/checkpoints/{row.checkpoint}"
            if metric in ("fid", "inception_score", "precision_recall"):
                assert cfg.image_log.num_samples == 50000 and cfg.image_log.log_fid
    assert any(r.baseline for r in spec.rows)
    if any(r.seed is not None for r in spec.rows):  # seed groups average several rows
        assert len({r.group for r in spec.rows}) < len(spec.rows)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_of_one_process_exits_with_the_signals_code(tiny):
    """Without torchrun the table's own process ends with 130 after its one line (under
    torchrun the code is torchrun's, the next test)."""
    table, ckpts = tiny
    log_path = ckpts / "ctrl_c_one.log"
    proc = popen(_table_cmd(table, ckpts, ckpts / "out_ctrl_c_one", "--rows", "at"), _env(), REPO,
                 output=str(log_path))
    deadline = time.monotonic() + 300
    while "at: accuracy done" not in (log_path.read_text() if log_path.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    code, _ = finish(proc, 120)
    text = log_path.read_text()
    assert code == 128 + signal.SIGINT, text[-4000:]
    assert len([line for line in text.splitlines() if "stopped by SIGINT" in line]) == 1, text
    assert not rebm_traceback_lines(text) and "Traceback" not in text, text[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_under_torchrun_stops_with_one_line_and_the_rerun_continues(tiny):
    """Ctrl-C to torchrun and both ranks once the first metric is stored: the job says once what
    it finished, no rank prints a traceback or a broken connection, the cache keeps what was
    computed, and the same command goes on from there."""
    table, ckpts = tiny
    out = ckpts / "out_ctrl_c"
    log_path = ckpts / "ctrl_c.log"
    proc = popen(_table_cmd(table, ckpts, out, "--rows", "at", nproc=2), _env(), REPO,
                 output=str(log_path))
    deadline = time.monotonic() + 300
    while "at: accuracy done" not in (log_path.read_text() if log_path.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    code, _ = finish(proc, 120)
    text = log_path.read_text()
    # torchrun's own code, whatever the ranks' 130: it re-raises the signal as an uncaught
    # SignalException (docs/evaluation.md, "Ctrl-C and SIGTERM")
    assert code == 1 and "table written" not in text, text[-4000:]
    assert "SignalException" in text, text[-4000:]
    stopped = [line for line in text.splitlines() if "stopped by" in line]
    assert len(stopped) == 1, text[-4000:]
    assert "stopped by SIGINT: no row finished; in row [1/1] at, accuracy" in stopped[0]
    assert stopped[0].endswith("run the same command to continue from there (the table is "
                               "written at the end)")
    assert len([line for line in text.splitlines() if "interrupt: stopping" in line]) == 1
    assert not rebm_traceback_lines(text) and "Connection closed" not in text, text[-4000:]
    assert "KeyboardInterrupt" not in text and "error:" not in text
    computed = stopped[0].split("in row [1/1] at, ")[1].split(" computed")[0].split(", ")
    # the same row again, narrowed to what the line named (the rest would only cost time)
    rerun = run_command(_table_cmd(table, ckpts, out, "--rows", "at", "--metrics", *computed),
                        timeout=400, env=_env()).assert_ok()
    assert (f"[1/1] at: {len(computed)} of {len(computed)} metrics already computed"
            in rerun.output), rerun.output[-3000:]
