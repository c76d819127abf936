"""Faults of evaluation lose nothing and produce no wrong number (issue 48, points 3 to 6), through
the real entry points in real processes: two evaluations into one folder at once, results files
written under a file-size limit (RLIMIT_FSIZE in a new interpreter), non-finite seed files,
reference statistics and settings, and table cells and caches that do not hold what they show.

The checkpoints are random-weight models of the quickstart's stage-2 config (digits, 16 px),
written here; FID uses rebm's stand-in features against statistics written here."""

from __future__ import annotations

import csv
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import REPO, RunResult, base_env, finish, rebm_traceback_lines, run_command
from tests.processes import popen
from tests.standins import STANDIN, write_standin_statistics

STAGE1 = "experiments/quickstart/digits.yaml"
STAGE2 = "experiments/quickstart/digits_stage2.yaml"
CHEAP = ["eval.num_images=24", "data.num_workers=0", "robust_eval_steps=2", "image_log.num_steps=2",
         "image_log.seed_images=noise", "--no-ece"]


def _env():
    return base_env(1, {"REBM_FID_FEATURES": STANDIN, "PYTHONPATH": str(REPO)})


def _write_checkpoint(path: Path, seed: int) -> Path:
    """A random-weight model of STAGE2's architecture, as a plain state dict file."""
    from rebm.config import load_config
    from rebm.models import model_from_config

    torch.manual_seed(seed)
    cfg = load_config(STAGE2, ["model.ckpt_path=null"])
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model_from_config(cfg.model, cfg.data).state_dict(), path)
    return path


def _evaluate(ckpt: Path, *extra: str) -> list:
    return [sys.executable, "-m", "rebm.eval.evaluate", STAGE2, f"model.ckpt_path={ckpt}", *CHEAP,
            *extra]


def _error_lines(output: str) -> list:
    return [line for line in output.splitlines() if line.startswith("error:")]


def _one_line_error(result: RunResult, *named: str) -> str:
    """The run failed with exactly one error line, naming each of `named`, and no traceback."""
    assert result.returncode != 0, result.output[-3000:]
    errors = _error_lines(result.output)
    assert len(errors) == 1, result.output[-3000:]
    assert "Traceback" not in result.output and not rebm_traceback_lines(result.output)
    for text in named:
        assert text in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    """A run's folder with its two model files, as training leaves them."""
    folder = tmp_path_factory.mktemp("run")
    _write_checkpoint(folder / "model_final.pth", seed=0)
    _write_checkpoint(folder / "model_bestacc.pth", seed=1)
    return folder


# --------------------------------------------------------------------------------------------
# 3. Two evaluations into one folder
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_evaluations_into_one_folder_at_once_do_not_mix_their_samples(run_folder, tmp_path):
    """model_final.pth and model_bestacc.pth of one run evaluated at once, both into the run's
    folder (the default): one owns the folder and writes every file; the other stops at
    start-up with one line naming the folder and the holder, and writes nothing. Run again
    once the first has ended, it writes its own."""
    folder = tmp_path / "run"
    folder.mkdir()
    for name in ("model_final.pth", "model_bestacc.pth"):
        os.link(run_folder / name, folder / name)
    samples = ["--metrics", "samples_npz", "image_log.num_samples=600", "image_log.num_steps=4"]
    commands = {name: _evaluate(folder / name, *samples)
                for name in ("model_final.pth", "model_bestacc.pth")}
    procs = {name: popen(cmd, _env(), REPO) for name, cmd in commands.items()}
    results = {name: RunResult(*finish(proc, 240), None) for name, proc in procs.items()}
    winners = [name for name, result in results.items() if result.returncode == 0]
    assert len(winners) == 1, {n: r.output[-2000:] for n, r in results.items()}
    winner = winners[0]
    loser = next(name for name in results if name != winner)
    line = _one_line_error(results[loser], f"output folder '{folder}' is in use by another "
                                           "evaluation (pid ")
    assert "run_dir=PATH" in line
    written = json.loads((folder / "eval.json").read_text())
    assert written["ckpt_path"] == str(folder / winner)
    with np.load(folder / "samples" / "samples.npz") as npz:
        rows = npz["arr_0"]
    assert rows.shape == (600, 16, 16, 3)
    assert (rows.reshape(600, -1).max(axis=1) > 0).all()  # no row left unwritten
    assert sorted(p.name for p in (folder / "samples").iterdir()) == ["samples.npz"]

    again = run_command(commands[loser], timeout=240, env=_env()).assert_ok()
    assert json.loads((folder / "eval.json").read_text())["ckpt_path"] == str(folder / loser)
    assert "in use" not in again.output


# --------------------------------------------------------------------------------------------
# 4. Results files under a file-size limit
# --------------------------------------------------------------------------------------------
def _limited(cmd: list, limit: int) -> RunResult:
    """`cmd` in a new interpreter whose files may not grow beyond `limit` bytes (RLIMIT_FSIZE;
    Python ignores SIGXFSZ, so a write past it fails with EFBIG); its output through a pipe."""
    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=set_limit)
    return RunResult(*finish(proc, 240), None)


def _contents(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".eval.lock"}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_failed_results_write_keeps_the_previous_files_and_leaves_nothing_behind(run_folder,
                                                                                   tmp_path):
    """A first evaluation writes eval.json and samples/samples.npz (reusing the .partial and
    .arr_0.npy a killed one left). Then, with a file-size limit: eval.json cannot be written
    (200 bytes), then the samples' .npy cannot be made (4096 bytes), then the npz cannot be
    assembled around a finished .npy (40 bytes short). Each is one line naming the file, the
    earlier files stay byte for byte, and no temporary file remains."""
    out = tmp_path / "out"
    ckpt = run_folder / "model_final.pth"
    npz = ["--metrics", "samples_npz", "image_log.num_samples=40"]
    samples = out / "samples"
    samples.mkdir(parents=True)
    (samples / "samples.npz.partial").write_bytes(b"PK\x03\x04 a killed run's" * 100)
    (samples / "samples.npz.arr_0.npy").write_bytes(b"\x93NUMPY" + b"\0" * 5000)
    run_command(_evaluate(ckpt, *npz, f"run_dir={out}"), timeout=240, env=_env()).assert_ok()
    before = _contents(out)
    assert sorted(before) == ["eval.json", "samples/samples.npz"]
    with np.load(samples / "samples.npz") as archive:
        assert archive["arr_0"].shape == (40, 16, 16, 3)

    failed = _limited(_evaluate(ckpt, f"run_dir={out}"), 200)
    # rank 0's write (on_main) says the room there was, as the checkpoint writers do
    _one_line_error(failed, f"cannot write {out / 'eval.json'}", "File too large",
                    "free on its filesystem, file-size limit 200 bytes (ulimit -f)")
    assert _contents(out) == before

    failed = _limited(_evaluate(ckpt, *npz, f"run_dir={out}"), 4096)
    _one_line_error(failed, str(samples / "samples.npz"), "File too large")
    assert _contents(out) == before

    # room for the .npy (every row written) but not for the npz around it: the .partial fails
    failed = _limited(_evaluate(ckpt, *npz, f"run_dir={out}"), len(before["samples/samples.npz"])
                      - 40)
    _one_line_error(failed, f"cannot write {samples / 'samples.npz'}", "File too large")
    assert _contents(out) == before


# --------------------------------------------------------------------------------------------
# 5. Non-finite inputs and settings
# --------------------------------------------------------------------------------------------
def _nan_seeds(kind: str) -> np.ndarray:
    rng = np.random.default_rng(0)
    if kind == "empty":
        return np.zeros((40, 3, 0, 16), np.float32)
    images = rng.random((40, 3, 16, 16)).astype(np.float32)
    if kind == "all-nan":
        images[:] = np.nan
    else:
        images[7, 1, 3, 5] = np.nan
    return images


@pytest.mark.parametrize("kind, named", [("all-nan", "NaN"), ("one-nan", "1 NaN"),
                                         ("empty", "no pixels")])
def test_a_seed_file_of_non_finite_or_no_pixels_is_one_line(run_folder, tmp_path, kind, named):
    """The [0, 1] check of a float seed file lets NaN through (every comparison with it is
    false): all-NaN seeds gave all-zero samples and a FID, one NaN pixel spread over its
    sample. A seed file of (N, 3, 0, W) gave a raw RuntimeError. Each is one line naming it."""
    seeds = tmp_path / f"{kind}.npy"
    np.save(seeds, _nan_seeds(kind))
    result = run_command(_evaluate(run_folder / "model_final.pth", "--samples",
                                   f"image_log.seed_images={seeds}", f"run_dir={tmp_path / 'out'}"),
                         timeout=120, env=_env())
    _one_line_error(result, "image_log.seed_images", str(seeds), named)
    assert not (tmp_path / "out" / "eval.json").exists()


def test_reference_statistics_with_a_nan_mu_are_one_line(run_folder, tmp_path):
    """FID against statistics with a NaN in mu was `nan`, stored as null, exit 0."""
    rng = np.random.default_rng(0)
    features = rng.random((64, 15))
    mu = features.mean(0)
    mu[4] = np.nan
    stats = tmp_path / "stats.npz"
    write_standin_statistics(stats, mu, np.cov(features, rowvar=False))
    result = run_command(_evaluate(run_folder / "model_final.pth", "--samples",
                                   "image_log.log_fid=true", f"image_log.data_dir={stats}",
                                   f"run_dir={tmp_path / 'out'}"), timeout=120, env=_env())
    _one_line_error(result, "image_log.data_dir", str(stats), "'mu'")
    assert not (tmp_path / "out" / "eval.json").exists()


@pytest.mark.parametrize("override, key", [("lr=.nan", "'lr: nan'"), ("lr=inf", "'lr: inf'"),
                                           ("wd=.inf", "'wd: inf'"),
                                           ("image_log.step_size=.nan", "'image_log.step_size"),
                                           ("ddp_timeout_s=.inf", "'ddp_timeout_s: inf'")])
def test_a_non_finite_setting_is_one_line_before_anything_is_written(tmp_path, override, key):
    """`lr: .nan` passed `lr <= 0` (every comparison with NaN is false), `lr: inf` and
    `wd: .inf` passed their range checks: training would start. Refused in one line naming the
    key, before the run directory exists."""
    run_dir = tmp_path / "run"
    result = run_command([sys.executable, "-m", "rebm.training.train", STAGE1, override,
                          "max_steps=1", f"run_dir={run_dir}"], timeout=120, env=_env())
    _one_line_error(result, key, "not a finite number")
    assert not run_dir.exists()


def test_a_non_finite_setting_in_a_file_is_named_with_the_file_and_a_radius_may_be_inf(tmp_path):
    from rebm.config import ConfigError, load_config

    config = tmp_path / "nan.yaml"
    config.write_text("lr: .nan\n")
    with pytest.raises(ConfigError, match=rf"^{config}: 'lr: nan' is not a finite number"):
        load_config(str(config))
    cfg = load_config(STAGE2, ["image_log.eps=.inf", "attack.eps=.inf",
                               "eval.counterfactual_eps=.inf"])
    assert cfg.image_log.eps == cfg.method.attack.eps == float("inf")
    with pytest.raises(ConfigError, match=r"'attack.eps: nan'"):
        load_config(STAGE2, ["attack.eps=.nan"])


# --------------------------------------------------------------------------------------------
# 6. Table cells and caches
# --------------------------------------------------------------------------------------------
def _table(tmp: Path, metrics, name: str = "t") -> Path:
    base = ["eval.num_images=24", "data.num_workers=0", "image_log.num_samples=12",
            "image_log.num_steps=2", "image_log.seed_images=noise", "image_log.log_fid=true",
            f"image_log.data_dir={tmp / 'stats.npz'}"]
    rows = [{"name": r, "group": "G", "seed": seed, "config": str(REPO / STAGE2),
             "checkpoint": f"{r}.pth"} for seed, r in enumerate(("a", "b"))]
    text = {"title": name, "metrics": list(metrics), "batch_size": 8, "overrides": base,
            "rows": rows}
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(text))  # JSON is YAML
    return path


def _run_table(table: Path, ckpts: Path, out: Path, *extra: str) -> RunResult:
    cmd = [sys.executable, "-m", "rebm.eval.table", str(table), "--checkpoints", str(ckpts),
           "--out", str(out), *extra]
    return RunResult(*finish(popen(cmd, _env(), REPO), 300), None)


def _computing(output: str, row: str) -> list:
    line = [x for x in output.splitlines() if f"] {row}: " in x and "already computed" in x][-1]
    return line.split("; computing ")[1].split(", ") if "; computing " in line else []


@pytest.fixture(scope="module")
def table_folder(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("table")
    for seed, row in enumerate(("a", "b")):
        _write_checkpoint(tmp / "ckpts" / f"{row}.pth", seed=seed)
    rng = np.random.default_rng(0)
    features = rng.random((64, 15))
    write_standin_statistics(tmp / "stats.npz", features.mean(0), np.cov(features, rowvar=False))
    return tmp


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_cell_that_averages_fewer_rows_than_its_group_says_so(table_folder, tmp_path):
    """A metric added to the table and `--rows b` run: the group's FID cell is b's value alone
    while the group lists both seeds. table.md says '(1 of 2 rows)', table.csv `fid_standin_n`
    1 beside `rows` 2; accuracy, which both rows have, says nothing more."""
    ckpts, out = table_folder / "ckpts", tmp_path / "out"
    (tmp_path / "stats.npz").write_bytes((table_folder / "stats.npz").read_bytes())
    _run_table(_table(tmp_path, ["accuracy"]), ckpts, out).assert_ok()
    table = _table(tmp_path, ["accuracy", "fid"])
    _run_table(table, ckpts, out, "--rows", "b").assert_ok()

    group = [x for x in (out / "table.md").read_text().splitlines() if x.startswith("| G |")][0]
    cells = [c.strip() for c in group.strip("|").split("|")]
    assert cells[1] == "0, 1"
    assert "(1 of 2 rows)" not in cells[2] and "±" in cells[2]  # accuracy: both rows
    fid_cells = [c for c in cells[2:] if "(1 of 2 rows)" in c]
    assert fid_cells, group
    with open(out / "table.csv") as fh:
        header, line = list(csv.reader(fh))
    found = dict(zip(header, line, strict=True))
    assert found["rows"] == "2" and found["fid_standin_n"] == "1"
    assert found["test_acc_n"] == "2"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cached_values_of_the_wrong_type_or_depth_are_computed_again(table_folder, tmp_path):
    """A string, a list or a null under a valid key was served as computed (and shown); a
    cache file of 200k nested brackets raised RecursionError. The first are computed again,
    the second is set aside as .corrupt with one warning line."""
    ckpts, out = table_folder / "ckpts", tmp_path / "out"
    (tmp_path / "stats.npz").write_bytes((table_folder / "stats.npz").read_bytes())
    table = _table(tmp_path, ["accuracy"])
    first = _run_table(table, ckpts, out, "--rows", "a").assert_ok()
    assert _computing(first.output, "a") == ["accuracy"]
    cache = out / "rows" / "a.json"
    stored = json.loads(cache.read_text())
    value = stored["metrics"]["accuracy"]["results"]["test_acc"]
    for wrong in ("0.99", [value], None):
        stored["metrics"]["accuracy"]["results"]["test_acc"] = wrong
        cache.write_text(json.dumps(stored))
        rerun = _run_table(table, ckpts, out, "--rows", "a").assert_ok()
        assert _computing(rerun.output, "a") == ["accuracy"], wrong
        again = json.loads(cache.read_text())["metrics"]["accuracy"]["results"]["test_acc"]
        assert again == value

    cache.write_text("[" * 200_000 + "]" * 200_000)
    rerun = _run_table(table, ckpts, out, "--rows", "a").assert_ok()
    assert "RecursionError" in rerun.output and "Traceback" not in rerun.output
    notices = [x for x in rerun.output.splitlines() if "is not a results cache" in x]
    assert len(notices) == 1 and str(cache) in notices[0]
    assert _computing(rerun.output, "a") == ["accuracy"]
    assert (out / "rows" / "a.json.corrupt").stat().st_size == 400_000
    assert json.loads(cache.read_text())["metrics"]["accuracy"]["results"]["test_acc"] == value


def test_a_table_into_a_folder_another_evaluation_holds_is_one_line(table_folder, tmp_path):
    """A table owns its --out folder as an evaluation owns its run_dir: while another process
    holds it, the table stops at start-up with one line and computes nothing."""
    ckpts, out = table_folder / "ckpts", tmp_path / "out"
    (tmp_path / "stats.npz").write_bytes((table_folder / "stats.npz").read_bytes())
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; "
                               "f = open(sys.argv[1], 'a+'); f.write('pid 1 on elsewhere'); "
                               "f.flush(); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); "
                               "time.sleep(120)", str(out / ".eval.lock")],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = _run_table(_table(tmp_path, ["accuracy"]), ckpts, out)
    finally:
        holder.kill()
        holder.wait()
    _one_line_error(result, f"output folder '{out}' is in use by another evaluation "
                            "(pid 1 on elsewhere)", "--out DIR")
    assert not (out / "rows").exists() and not (out / "table.md").exists()
