"""Issue 29's console points, each from the real entry point or command: the resume hint, the
quiet setup, the CPU-wheel option of `make setup`, what evaluation prints and writes."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from rebm.config import default_run_dir, load_config, to_dict
from tests.helpers import CONFIG, FAST, REPO, base_env, finish, run_separately, wait_for_records
from tests.processes import popen

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_the_resume_hint_of_a_default_run_dir_is_the_plain_command(tmp_path):
    """Stopped by Ctrl-C in its default run_dir, the run says only to run the same command (a
    run_dir the user chose is named: tests/test_resume.py)."""
    config = str(REPO / CONFIG)
    args = [*FAST, "max_steps=400", "n_imgs_per_ckpt_save=100000"]
    run_dir = tmp_path / default_run_dir(config, args, to_dict(load_config(config, args)))
    proc = popen([sys.executable, "-m", "rebm.training.train", config, *args], base_env(1),
                 tmp_path)
    wait_for_records(run_dir, 1, proc)
    os.killpg(proc.pid, signal.SIGINT)
    code, out = finish(proc, timeout=60)
    assert code == 0, out[-4000:]
    hint = [line for line in out.splitlines() if "stopped by SIGINT" in line]
    assert len(hint) == 1, out[-4000:]
    assert hint[0].endswith("; run the same command to resume"), hint
    assert "run_dir" not in hint[0] and "Traceback" not in out
    assert list((run_dir / "checkpoints").glob("state_*.pt"))


def make_setup_commands(*variables):
    """The commands `make setup` would run in a fresh checkout (-B: as if .venv were absent)."""
    # under `make test` this make is a sub-make: without MAKEFLAGS/MAKELEVEL and with
    # --no-print-directory it prints the commands alone
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(["make", "--no-print-directory", "-n", "-B", "setup", "PYTHON=python3",
                          *variables], cwd=REPO, check=True, env=env, capture_output=True,
                         text=True).stdout
    return out.splitlines()


def test_make_setup_keeps_pip_errors_but_not_the_editable_install_banner():
    """pip -q -q still prints its ERROR lines (a missing requirement, checked by hand with pip
    26.3) but hides setuptools' 'Editable installation' BuildBackendWarning banner, which a
    single -q lets through; torch and torchvision come from PyPI's default index, as before."""
    assert make_setup_commands() == [
        "test -x .venv/bin/python || python3 -m venv .venv",
        '.venv/bin/python -m pip install --quiet --upgrade pip "setuptools>=77"',
        ".venv/bin/python -m pip install --quiet torch==2.14.1 torchvision==0.29.1",
        '.venv/bin/python -m pip install -q -q -e ".[dev]"',
        "touch .venv/.installed",
    ]


def test_make_setup_torch_index_installs_torch_from_that_index():
    """`make setup TORCH_INDEX=...` (the README's CPU-only setup) hands the index to the pip
    command that installs torch and torchvision, and to no other."""
    url = "https://download.pytorch.org/whl/cpu"
    default, chosen = make_setup_commands(), make_setup_commands(f"TORCH_INDEX={url}")
    torch_line = (".venv/bin/python -m pip install --quiet --index-url "
                  f"{url} torch==2.14.1 torchvision==0.29.1")
    assert chosen == [torch_line if "torch==" in line else line for line in default]
    assert sum(url in line for line in chosen) == 1


def test_make_setup_system_torch_keeps_the_installed_pair():
    """`make setup SYSTEM_TORCH=1`: a venv over the system's packages, no torch installed, and
    the editable install constrained to the torch and torchvision found there."""
    commands = make_setup_commands("SYSTEM_TORCH=1")
    assert commands[0] == "test -x .venv/bin/python || python3 -m venv --system-site-packages .venv"
    assert not any("pip install --quiet torch==" in line for line in commands)
    assert any("> .venv/system-torch.txt" in line and "SYSTEM_TORCH=1:" in line for line in commands)
    assert '.venv/bin/python -m pip install -q -q -c .venv/system-torch.txt -e ".[dev]"' in commands


def test_make_test_oldest_builds_its_own_venv_with_the_lower_end_of_the_range():
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(["make", "--no-print-directory", "-n", "test-oldest"], cwd=REPO,
                         check=True, env=env, capture_output=True, text=True).stdout
    assert "setup VENV=.venv-oldest TORCH=2.8.0 TORCHVISION=0.23.0" in out
    assert '.venv-oldest/bin/python -m pytest' in out and '-m "not slow or bridge"' in out
    lower = make_setup_commands("VENV=.venv-oldest", "TORCH=2.8.0", "TORCHVISION=0.23.0")
    assert ".venv-oldest/bin/python -m pip install --quiet torch==2.8.0 torchvision==0.23.0" in lower


def run_evaluate(tmp_path, *args, ckpt_dir=None):
    """`python -m rebm.eval.evaluate` of a random-weight digits model (tiny attack and samples):
    (exit code, console output)."""
    from rebm.models import build_model, dataset_stats

    ckpt_dir = ckpt_dir or tmp_path
    ckpt = ckpt_dir / "model_final.pth"
    if not ckpt.exists():
        torch.manual_seed(0)
        mean, std = dataset_stats("digits")
        torch.save(build_model("WideResNet10x1", 10, mean=mean, std=std).state_dict(), ckpt)
    cmd = [sys.executable, "-m", "rebm.eval.evaluate", str(REPO / CONFIG), f"model.ckpt_path={ckpt}",
           "indist_attack_clf.max_steps=1", "robust_eval_steps=1", "--no-ece", *args]
    return finish(popen(cmd, base_env(1), REPO), timeout=150)


def test_evaluate_says_first_where_eval_json_goes_and_writes_the_radius_inf(tmp_path):
    """The console names eval.json's path (the checkpoint's folder, a training run's own) before
    the evaluation, and says when it replaces one; the samples' radius, `.inf` in the config,
    is the string "inf" in eval.json (it was 1e+308)."""
    samples = ["--samples", "image_log.num_steps=1", "image_log.num_samples=10"]
    code, out = run_evaluate(tmp_path, *samples)
    assert code == 0, out[-4000:]
    lines = out.splitlines()
    notice = [i for i, line in enumerate(lines) if "eval.json will be written to" in line]
    assert len(notice) == 1, out[-4000:]
    assert lines[notice[0]].endswith(f"{tmp_path / 'eval.json'}, the checkpoint's folder "
                                     "(run_dir=PATH writes it elsewhere)")
    assert notice[0] < next(i for i, line in enumerate(lines) if "robust acc" in line)
    written = json.loads((tmp_path / "eval.json").read_text())
    assert written["settings"]["sample_grid"]["eps"] == "inf"
    assert "e+308" not in (tmp_path / "eval.json").read_text()
    code, out = run_evaluate(tmp_path)  # again: it replaces that file
    assert code == 0 and f"{tmp_path / 'eval.json'}, the checkpoint's folder, replacing the one " \
        "there (run_dir=PATH writes it elsewhere)" in out, out[-4000:]
    assert "Traceback" not in out


def test_an_ids_file_holding_a_word_is_refused_naming_the_word_and_the_file(tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text("3\nbanana\n")
    code, out = run_evaluate(tmp_path, f"eval.image_ids={ids}")
    assert code == 2, out[-4000:]
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert errors == [f"error: eval.image_ids '{ids}': 'banana' is not a 0-based index, and the "
                      "test split of digits has no files to name by path; write one 0-based "
                      "index a line"], out[-4000:]
    assert "Traceback" not in out


def _accuracy_blue_pixels(tmp_path, confidence: float) -> int:
    """Pixels of matplotlib's first colour (the accuracy bars) in the reliability diagram of
    100 images in one bin, 90 of them correct, at the mean `confidence`."""
    import numpy as np
    from PIL import Image

    from rebm.eval.metrics.calibration import N_BINS, reliability_diagram

    sums = torch.zeros(3, N_BINS, dtype=torch.float64)
    sums[:, N_BINS - 1] = torch.tensor([100.0, 100 * confidence, 90.0])
    path = tmp_path / f"reliability_{confidence}.png"
    reliability_diagram(sums, abs(0.9 - confidence), str(path))
    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB")).astype(int)
    return int((np.abs(pixels - [31, 119, 180]).sum(axis=2) <= 6).sum())


def test_the_reliability_diagram_keeps_an_underconfident_bins_accuracy_bar_visible(tmp_path):
    """Accuracy 0.9 at confidence 0.5: the gap (0.5 to 0.9) lies over the accuracy bar. Hatched,
    it leaves most of the bar's colour: 92% of the calibrated bar's pixels (the red fill of alpha
    0.3 drawn before left 68%)."""
    calibrated, underconfident = (_accuracy_blue_pixels(tmp_path, c) for c in (0.9, 0.5))
    assert calibrated > 500
    assert underconfident >= 0.75 * calibrated, (underconfident, calibrated)


@pytest.mark.parametrize("bars", ["1", "0"])
def test_autoattack_says_how_far_its_chunks_are_when_progress_is_on(tmp_path, monkeypatch,
                                                                     bars):
    """12 test images in chunks of 4: with progress on (REBM_PROGRESS=1, as on a terminal) one
    line per chunk with the images done and those still robust; off (a log file) none."""
    import re

    monkeypatch.setenv("REBM_PROGRESS", bars)  # base_env copies os.environ
    code, out = run_evaluate(tmp_path, "eval.num_images=12", "per_device_eval_batch_size=4",
                             "--autoattack")
    assert code == 0, out[-4000:]
    lines = re.findall(r"AutoAttack on rank 0: chunk (\d) done, (\d+) images, (\d+) robust so far",
                       out)
    if bars == "0":
        assert lines == [] and "robust after" not in out
        return
    assert [(int(k), int(n)) for k, n, _ in lines] == [(1, 4), (2, 8), (3, 12)], out[-4000:]
    # and one line after each attack the library runs (on a chunk with images left to attack)
    attacks = re.findall(r"AutoAttack on rank 0: chunk (\d), robust after ([A-Z-]+): ", out)
    assert "APGD-CE" in {a for _, a in attacks} and {a for _, a in attacks} <= {
        "APGD-CE", "APGD-T", "FAB-T", "SQUARE"}, out[-4000:]
    robust = [int(r) for _, _, r in lines]
    assert robust == sorted(robust) and robust[-1] == round(
        json.loads(out.strip().splitlines()[-1])["autoattack_test_acc"] * 12)


def run_check(*argv):
    """The training entry point, forked from the preloaded server (stdout and stderr apart)."""
    return run_separately([sys.executable, "-m", "rebm.training.train", *argv], base_env(1),
                          timeout=120)


def test_check_shows_what_the_user_set_and_what_differs_and_all_shows_every_key(tmp_path):
    import yaml

    from rebm.config import to_dict
    from rebm.config.identity import flatten as flat_values

    shipped = (REPO / "experiments/imagenet/imagenet-dat-WideResNet50x4ImageNet-T30-256x256.yaml").read_text()
    config = tmp_path / "no_image_size.yaml"  # the ImageNet default (256) fills it in
    config.write_text(shipped.replace("  image_size: 256\n", ""))
    tiny = ["lr=0.0123", "model.model_type=TinyResNetImageNet"]  # a cheap memory plan
    short = run_check(str(config), "--check", *tiny)
    assert short.returncode == 0, short.stderr
    shown = flat_values(yaml.safe_load(short.stdout))
    full = flat_values(to_dict(load_config(str(config), tiny)))
    assert shown["lr"] == 0.0123  # the command line
    assert shown["data.image_size"] == 256  # not in the file: ImageNet's default, not 32
    assert shown.pop("run_dir").startswith("runs/")  # the default run_dir a training gets
    assert {k: full[k] for k in shown} == shown  # every value shown is the resolved one
    for legacy in ("r1_indist_weight", "tinyimages_loader", "mixup_alpha"):  # nobody set them
        assert legacy not in shown
    hidden = len(full) - len(shown) - 1
    assert f"# {hidden} more keys at their defaults (--check --all prints every key)" in short.stdout
    every = run_check(str(config), "--check", "--all", *tiny)
    assert every.returncode == 0 and flat_values(yaml.safe_load(every.stdout)).keys() == full.keys()
    alone = run_check(str(config), "--all")
    assert alone.returncode == 2
    assert alone.stderr.strip() == "error: --all only goes with --check (it prints the whole config)"


def test_the_shipped_stand_in_works_from_anywhere_and_labels_what_it_makes(tmp_path,
                                                                           monkeypatch):
    """REBM_FID_FEATURES=rebm.eval.standin:features from a folder outside the repository: the
    statistics are written, the console line and the file say STAND-IN, and an FID with another
    network refuses the file in one line."""
    import numpy as np

    from rebm.eval.features import fid

    out = tmp_path / "stats.npz"
    env = {k: v for k, v in base_env(1).items() if k != "PYTHONPATH"}
    env["REBM_FID_FEATURES"] = "rebm.eval.standin:features"
    proc = subprocess.run([sys.executable, "-m", "rebm.eval.fid_stats", str(REPO / CONFIG),
                           "--out", str(out), "--num-images", "64", "data.num_workers=0",
                           f"data.indist_ds_dir={tmp_path}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("STAND-IN FID statistics (rebm.eval.standin:features, not Inception) of 64 train "
            "images written to") in proc.stderr, proc.stderr
    with np.load(out) as stats:
        assert str(stats["features"]) == "stand-in rebm.eval.standin:features"
    assert json.loads(proc.stdout.strip().splitlines()[-1])["features"].startswith("stand-in")
    standin = fid.FeatureNetwork("standin", spec="rebm.eval.standin:features")
    assert fid.load_reference(str(out), standin)[0].shape == (15,)  # the same stand-in reads it
    with pytest.raises(fid.FIDError, match="holds statistics of stand-in rebm.eval.standin:"
                       "features features, but this run computes Inception-v3 pool3"):
        fid.load_reference(str(out), fid.FeatureNetwork("inception"))  # an Inception FID must not


def test_the_standin_recipe_computes_fid_and_without_log_fid_says_which_key(tmp_path, monkeypatch):
    """docs/evaluation.md "Without the Inception weights", as written (smaller samples): the
    evaluation prints the stand-in FID; with `image_log.log_fid` left off it says, in one line,
    that FID was not computed and which key turns it on."""
    monkeypatch.setenv("REBM_FID_FEATURES", "rebm.eval.standin:features")
    stats = tmp_path / "stats.npz"
    code, out = finish(popen([sys.executable, "-m", "rebm.eval.fid_stats", str(REPO / CONFIG),
                              "--out", str(stats)], base_env(1), REPO), timeout=150)
    assert code == 0 and stats.exists(), out
    small = [f"image_log.data_dir={stats}", "image_log.num_samples=20", "image_log.num_steps=2"]
    code, out = run_evaluate(tmp_path, *small, "image_log.log_fid=true", "--samples")
    assert code == 0 and "fid_standin" in out and "FID not computed" not in out, out
    code, out = run_evaluate(tmp_path, *small, "--samples")
    notices = [line for line in out.splitlines() if "FID not computed" in line]
    assert code == 0 and "fid_standin" not in out, out
    assert len(notices) == 1 and "image_log.log_fid=true" in notices[0], out
