"""The table runner's results cache never serves a stale number, `--check` lists what a table
needs before any work, and a run with missing checkpoints says so in its exit code.

One tiny table (digits, a random-weight WideResNet-10-1 checkpoint written here, accuracy and FID
of stand-in features against a statistics file written here) runs again and again through the
real entry point `python -m rebm.eval.table`; each run's log says which metrics it computed."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import REPO, RunResult, base_env, finish, run_command
from tests.processes import popen
from tests.standins import write_standin_statistics

STANDIN = "rebm.eval.standin:features"
STAGE2 = "experiments/quickstart/digits_stage2.yaml"
PAPER_TABLES = sorted((REPO / "experiments" / "paper").glob("*.yaml"))


def _env():
    return base_env(1, {"REBM_FID_FEATURES": STANDIN, "PYTHONPATH": str(REPO)})


def _write_checkpoint(path: Path, seed: int) -> None:
    """A random-weight model of STAGE2's architecture, as a plain state dict file."""
    from rebm.config import load_config
    from rebm.models import model_from_config

    torch.manual_seed(seed)
    cfg = load_config(STAGE2, ["model.ckpt_path=null"])
    model = model_from_config(cfg.model, cfg.data)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)


def _write_stats(path: Path, seed: int) -> None:
    """FID reference statistics of the 15-d stand-in features, in pytorch-fid's npz format."""
    rng = np.random.default_rng(seed)
    features = rng.random((64, 15))
    write_standin_statistics(path, features.mean(0), np.cov(features, rowvar=False))


def _table(tmp: Path, name: str, metrics, rows, overrides=(), metric_overrides=None) -> Path:
    base = ["eval.num_images=24", "data.num_workers=0", f"data.indist_ds_dir={tmp}",
            "image_log.num_samples=12", "image_log.num_steps=2", "image_log.log_fid=true",
            f"image_log.data_dir={tmp / 'stats.npz'}", *overrides]
    text = {"title": name, "metrics": list(metrics), "batch_size": 8, "overrides": base,
            "metric_overrides": metric_overrides or {},
            "rows": [{"name": r, "config": str(REPO / STAGE2), "checkpoint": f"{r}.pth"}
                     for r in rows]}
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(text))  # JSON is YAML
    return path


def _run(table: Path, ckpts: Path, out: Path, *extra: str, cwd: Path = REPO) -> RunResult:
    """The table command, run in `cwd` (relative data paths are looked up there second)."""
    cmd = [sys.executable, "-m", "rebm.eval.table", str(table), "--checkpoints", str(ckpts),
           "--out", str(out), *extra]
    return RunResult(*finish(popen(cmd, _env(), cwd), 300), None)


def _computing(output: str) -> list:
    """The metrics the run computed for its (only) row, from its progress line."""
    line = [x for x in output.splitlines() if "metrics already computed" in x][-1]
    found = re.search(r"; computing (.*)$", line)
    return found.group(1).split(", ") if found else []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cache")
    ckpts = tmp / "ckpts"
    _write_checkpoint(ckpts / "a.pth", seed=0)
    _write_stats(tmp / "stats.npz", seed=0)
    return tmp, ckpts


def test_a_metric_is_recomputed_exactly_when_what_it_depends_on_changes(tiny):
    tmp, ckpts = tiny
    out = tmp / "out"
    table = _table(tmp, "t", ["accuracy", "fid"], ["a"])
    first = _run(table, ckpts, out).assert_ok()
    assert _computing(first.output) == ["accuracy", "fid"]
    assert _computing(_run(table, ckpts, out).assert_ok().output) == []

    # statistics file rewritten in place: FID reads it, accuracy does not
    _write_stats(tmp / "stats.npz", seed=1)
    assert _computing(_run(table, ckpts, out).assert_ok().output) == ["fid"]

    # another checkpoint of the same size and modification time: both
    ckpt = ckpts / "a.pth"
    before = ckpt.stat()
    _write_checkpoint(ckpt, seed=1)
    os.utime(ckpt, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert ckpt.stat().st_size == before.st_size and ckpt.stat().st_mtime_ns == before.st_mtime_ns
    assert _computing(_run(table, ckpts, out).assert_ok().output) == ["accuracy", "fid"]

    # data.image_size of FID only (the samples' size), then of every metric: only the metric
    # whose size changed is computed again (FID is already at 12 px)
    table = _table(tmp, "t", ["accuracy", "fid"], ["a"],
                   metric_overrides={"fid": ["data.image_size=12"]})
    assert _computing(_run(table, ckpts, out).assert_ok().output) == ["fid"]
    table = _table(tmp, "t", ["accuracy", "fid"], ["a"], overrides=["data.image_size=12"])
    assert _computing(_run(table, ckpts, out).assert_ok().output) == ["accuracy"]

    # a corrupt cache file: one notice naming it, kept aside, everything computed again
    cache = out / "rows" / "a.json"
    cache.write_text('{"metrics": {"accuracy": ')
    rerun = _run(table, ckpts, out).assert_ok()
    notices = [x for x in rerun.output.splitlines() if "is not a results cache" in x]
    assert len(notices) == 1 and str(cache) in notices[0], rerun.output
    assert _computing(rerun.output) == ["accuracy", "fid"]
    assert (out / "rows" / "a.json.corrupt").read_text() == '{"metrics": {"accuracy": '
    assert set(json.loads(cache.read_text())["metrics"]) == {"accuracy", "fid"}

    # a cache of the right JSON but the wrong shape counts as corrupt too
    cache.write_text('{"metrics": {"accuracy": {"results": 1}}}')
    rerun = _run(table, ckpts, out, "--metrics", "accuracy").assert_ok()
    assert "metric 'accuracy' has no key and results" in rerun.output
    assert _computing(rerun.output) == ["accuracy"]


def test_file_hashes_read_each_file_once_and_count_folders_by_path(tmp_path):
    from rebm.eval.table.cache import FileHashes

    hashes = FileHashes()
    path = tmp_path / "x.bin"
    path.write_bytes(b"one")
    first = hashes.identity(str(path))
    path.write_bytes(b"two")  # within one run the first read stands
    assert hashes.identity(str(path)) == first and first.startswith("sha256 ")
    assert FileHashes().identity(str(path)) != first
    assert hashes.identity(str(tmp_path)) == f"folder {tmp_path}"
    assert hashes.identity(str(tmp_path / "no")) == f"missing {tmp_path / 'no'}"
    assert hashes.identity(None) is None


def test_a_seed_folder_counts_by_its_files_a_dataset_root_by_its_path(tmp_path):
    """A seed image replaced in place changes the key of the sample metrics; a dataset root
    (1.3M ImageNet files) is not listed."""
    from rebm.eval.table.cache import FileHashes

    seeds = tmp_path / "seeds"
    (seeds / "a").mkdir(parents=True)
    (seeds / "a" / "0.png").write_bytes(b"one")
    first = FileHashes().identity(str(seeds), "image_log.seed_images")
    assert first.startswith("folder manifest ")
    (seeds / "a" / "0.png").write_bytes(b"other")
    assert FileHashes().identity(str(seeds), "image_log.seed_images") != first
    (seeds / "a" / "1.png").write_bytes(b"new")
    assert FileHashes().identity(str(seeds), "image_log.seed_images") != first
    assert FileHashes().identity(str(seeds), "data.indist_ds_dir") == f"folder {seeds}"


def test_skipped_rows_still_write_the_table_and_exit_non_zero(tiny, tmp_path):
    tmp, ckpts = tiny
    table = _table(tmp, "skip", ["accuracy"], ["a", "b"])
    result = _run(table, ckpts, tmp_path / "out")
    assert result.returncode != 0
    assert "b: checkpoint missing" in result.output
    last = result.output.strip().splitlines()[-1]
    assert "1 row(s) skipped, checkpoint missing: b" in last and "Traceback" not in result.output
    markdown = (tmp_path / "out" / "table.md").read_text()
    assert "| a | a | " in markdown and f"- b: expected `{ckpts / 'b.pth'}`" in markdown


def test_a_missing_checkpoints_folder_is_one_line(tiny, tmp_path):
    tmp, _ = tiny
    table = _table(tmp, "t", ["accuracy"], ["a"])
    result = _run(table, tmp_path / "nope", tmp_path / "out")
    assert result.returncode == 2
    assert result.output.strip() == (f"error: --checkpoints folder '{tmp_path / 'nope'}' does "
                                     "not exist; pass the folder the rows' checkpoint paths are "
                                     "relative to")
    assert not (tmp_path / "out").exists()


def test_check_lists_each_rows_files_and_computes_nothing(tiny, tmp_path):
    tmp, ckpts = tiny
    table = _table(tmp, "check", ["accuracy", "fid"], ["a", "b"])
    result = _run(table, ckpts, tmp_path / "out", "--check", "--verbose")
    assert result.returncode == 1, result.output
    lines = result.output.splitlines()
    assert f"  present  checkpoint: {ckpts / 'a.pth'}" in lines
    assert f"  MISSING  checkpoint: {ckpts / 'b.pth'}" in lines
    assert f"  present  image_log.data_dir: {tmp / 'stats.npz'}  [fid]" in lines
    assert lines[-1].startswith("check: 1 of ") and "in row(s) b; nothing was computed" in lines[-1]
    assert not (tmp_path / "out").exists()
    present = _run(table, ckpts, tmp_path / "out", "--check", "--rows", "a")
    assert present.returncode == 0, present.output
    assert present.output.splitlines()[-1].startswith("check: all ")


@pytest.mark.parametrize("table", PAPER_TABLES, ids=[p.stem for p in PAPER_TABLES])
def test_check_of_every_paper_table_without_checkpoints_lists_them_missing(table, tmp_path):
    from rebm.eval.table.spec import load_table

    result = run_command([sys.executable, "-m", "rebm.eval.table", str(table), "--checkpoints",
                          str(tmp_path), "--check", "--verbose"], timeout=120, env=base_env(1))
    assert result.returncode == 1, result.output
    for row in load_table(str(table)).rows:
        assert f"  MISSING  checkpoint: {tmp_path / row.checkpoint}" in result.output
    assert "nothing was computed" in result.output.splitlines()[-1]
    assert "Traceback" not in result.output
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_check_passes_for_a_dataset_that_reads_no_files(tiny, tmp_path):
    """digits come with scikit-learn (the registry: reads_files=False): `--check` lists no
    dataset root for them, so it can pass and be a job script's go/no-go step."""
    tmp, ckpts = tiny
    table = _table(tmp, "digits", ["accuracy", "fid"], ["a"],
                   overrides=[f"data.indist_ds_dir={tmp_path / 'absent'}"])
    result = _run(table, ckpts, tmp_path / "out", "--check")
    assert result.returncode == 0, result.output
    assert "data.indist_ds_dir" not in result.output
    assert result.output.splitlines()[-1].startswith("check: all ")


def _rows_lines(markdown: str, row: str) -> list:
    return [x for x in markdown.splitlines() if x.startswith(f"| {row} |")]


def test_rows_reads_no_checkpoint_of_the_rows_it_leaves_out(tiny, tmp_path):
    """--rows a computes and hashes a alone: b's checkpoint (gigabytes for ImageNet models) is
    not read, b shows the values cached for the checkpoint content recorded when it ran, and a
    run without --rows reads it again."""
    tmp, ckpts = tiny
    mine = tmp_path / "ckpts"
    shutil.copytree(ckpts, mine)
    _write_checkpoint(mine / "b.pth", seed=2)
    table, out = _table(tmp, "rows", ["accuracy"], ["a", "b"]), tmp_path / "out"
    first = _run(table, mine, out).assert_ok()
    assert _computing(first.output) == ["accuracy"]
    shown = _rows_lines((out / "table.md").read_text(), "b")
    assert shown, (out / "table.md").read_text()

    # b's file is now no checkpoint at all: hashing it would change b's keys (and loading it
    # would fail), so b's line unchanged shows the file was not read
    (mine / "b.pth").write_bytes(b"not a checkpoint" * 4096)
    result = _run(table, mine, out, "--rows", "a").assert_ok()
    assert "1 of 1 metrics already computed" in result.output
    assert _rows_lines((out / "table.md").read_text(), "b") == shown
    assert "rows not selected by --rows (b): shown with the values cached" in result.output

    _write_checkpoint(mine / "b.pth", seed=3)  # a run of the whole table reads every file
    assert _computing(_run(table, mine, out).assert_ok().output) == ["accuracy"]


def test_two_settings_that_draw_the_same_samples_share_their_cached_values(tiny, tmp_path):
    """eval.unconditional_samples=true and logsumexp_sampling=true draw the same samples: the
    key holds what the samples are, not which setting decided it."""
    tmp, ckpts = tiny
    out = tmp_path / "out"
    for overrides, computed in ((["eval.unconditional_samples=true"], ["fid"]),
                                (["logsumexp_sampling=true"], []),
                                ([], ["fid"])):  # class-conditional: other samples
        table = _table(tmp, "kinds", ["fid"], ["a"], overrides=overrides)
        assert _computing(_run(table, ckpts, out).assert_ok().output) == computed, overrides


def test_relative_data_paths_are_read_under_checkpoints_then_the_current_directory(tiny,
                                                                                 tmp_path):
    """One rule for the run and --check (rebm/eval/table/paths.py), and --check says where it
    looked."""
    tmp, ckpts = tiny
    root, here = tmp_path / "original", tmp_path / "here"
    shutil.copytree(ckpts, root)
    here.mkdir()
    stats = "data/fid_stats/stats.npz"
    table = _table(tmp, "rel", ["fid"], ["a"], overrides=[f"image_log.data_dir={stats}"])
    rule = (f"relative data paths: looked up in {root} (--checkpoints) first, then in {here} "
            "(the current directory)")

    nowhere = _run(table, root, tmp_path / "out", "--check", "--verbose", cwd=here)
    assert nowhere.returncode == 1 and nowhere.output.splitlines()[0] == rule, nowhere.output
    assert (f"  MISSING  image_log.data_dir: {stats} (looked in {root}, then {here})  [fid]"
            in nowhere.output.splitlines()), nowhere.output
    stopped = _run(table, root, tmp_path / "out", cwd=here)
    assert stopped.returncode == 2 and "Traceback" not in stopped.output
    assert f"(relative data paths: looked in {root}, then {here})" in stopped.output

    (here / stats).parent.mkdir(parents=True)
    _write_stats(here / stats, seed=0)
    found = _run(table, root, tmp_path / "out", "--check", "--verbose", cwd=here)
    assert f"  present  image_log.data_dir: {stats}  [fid]" in found.output.splitlines()
    _run(table, root, tmp_path / "out", cwd=here).assert_ok()
    in_here = json.loads((tmp_path / "out" / "rows" / "a.json").read_text())["metrics"]["fid"]

    (root / stats).parent.mkdir(parents=True)
    _write_stats(root / stats, seed=1)  # other statistics, under --checkpoints: they win
    found = _run(table, root, tmp_path / "out", "--check", "--verbose", cwd=here)
    assert f"  present  image_log.data_dir: {root / stats}  [fid]" in found.output.splitlines()
    again = _run(table, root, tmp_path / "out", cwd=here).assert_ok()
    assert _computing(again.output) == ["fid"]
    in_root = json.loads((tmp_path / "out" / "rows" / "a.json").read_text())["metrics"]["fid"]
    assert in_root["results"] != in_here["results"]
