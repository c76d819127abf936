"""Every FID says what made it: the Inception weights file is checked against the pinned size and
SHA-256 before any network is built from it, another file's numbers go only under `*_unverified`
keys, statistics record their network and recipe, and FID refuses statistics of another network
(docs/evaluation.md, "The Inception weights" and "The reference statistics").

The real file cannot be downloaded here: the refused files are a file of the pinned size with
other bytes and a truncated one; the accepted unverified file holds random weights of pytorch-fid's
architecture (tests/standins.py)."""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rebm.eval.features import fid, network
from rebm.standin.writers import write_fake_cifar10, write_fake_imagenet
from tests.helpers import (
    REPO,
    base_env,
    error_lines,
    rebm_traceback_lines,
    run_command,
    torchrun_cmd,
)
from tests.standins import STANDIN, random_fid_inception_state

pytestmark = pytest.mark.numbers

OVERRIDES = ["data.indist_dataset=cifar10", "data.num_workers=0", "data.outdist_dataset=noise",
             "data.image_size=16", "model.model_type=WideResNet10x1", "robust_eval=false",
             "image_log.step_size=0.5", "image_log.num_samples=12", "image_log.num_steps=1",
             "rand_seed=3", "eval.num_images=8"]
PINNED = f"expected {network.INCEPTION_BYTES:,} bytes, sha256 {network.INCEPTION_SHA256[:8]}"


def test_pinned_digest_begins_with_both_libraries_file_name_suffix():
    """A tripwire for an upstream rename, not a proof of the pin: pytorch-fid's and
    torch-fidelity's URLs name the file by the digest's first 8 hex digits."""
    from pytorch_fid.inception import FID_WEIGHTS_URL
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3

    for url in (FID_WEIGHTS_URL, URL_INCEPTION_V3):
        suffix = url.rsplit("-", 1)[1].removesuffix(".pth")
        assert suffix == network.INCEPTION_SHA256[:8], url
    assert network.INCEPTION_WEIGHTS_FILE == os.path.basename(FID_WEIGHTS_URL)


def test_a_file_is_hashed_once_per_process_and_again_when_it_changes(tmp_path):
    path = tmp_path / "w.pth"
    path.write_bytes(b"a" * 1000)
    before = network._sha256.cache_info().misses
    first = network.file_sha256(str(path))
    assert network.file_sha256(str(path)) == first
    assert network._sha256.cache_info().misses == before + 1
    path.write_bytes(b"b" * 1001)
    assert network.file_sha256(str(path)) != first


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(folder, config file, overrides, a random-weights Inception file, the same size
    with other bytes, a truncated copy): a tiny CIFAR-10 and a random WideResNet."""
    from rebm.models import build_model

    tmp = tmp_path_factory.mktemp("inception")
    write_fake_cifar10(str(tmp), n_train=40, n_test=11)
    torch.manual_seed(0)
    torch.save(build_model("WideResNet10x1", 10).state_dict(), tmp / "model.pth")
    config = tmp / "config.yaml"
    config.write_text("rand_seed: 3\n")
    overrides = [*OVERRIDES, f"data.indist_ds_dir={tmp}", f"model.ckpt_path={tmp / 'model.pth'}"]
    random = tmp / "random_inception.pth"
    torch.save(random_fid_inception_state(), random)
    same_size = tmp / "same_size.pth"
    with open(same_size, "wb") as fh:  # the pinned size, other bytes: only the digest tells
        fh.truncate(network.INCEPTION_BYTES)
    truncated = tmp / "truncated.pth"
    truncated.write_bytes(random.read_bytes()[: 1 << 20])
    return tmp, str(config), overrides, random, same_size, truncated


def _env(**extra):
    return base_env(1, {"PYTHONPATH": str(REPO), **extra})


def _table_file(tmp: Path, config: str, overrides) -> Path:
    lines = ["title: one row", "metrics: [fid]", "batch_size: 8", "overrides:",
             *[f"  - '{o}'" for o in overrides if not o.startswith("model.ckpt_path")],
             "  - image_log.log_fid=true", f"  - image_log.data_dir={tmp / 'absent_stats.npz'}",
             "rows:", "  - name: only", f"    config: {config}", "    checkpoint: model.pth"]
    path = tmp / "table.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _entry_args(entry: str, setup, weights: Path, out: Path):
    tmp, config, overrides = setup[:3]
    chosen = f"image_log.inception_weights={weights}"
    if entry == "rebm.eval.evaluate":
        return [config, *overrides, chosen, "image_log.log_fid=true",
                f"image_log.data_dir={tmp / 'absent_stats.npz'}", "--samples", "--no-ece",
                f"run_dir={out}"]
    if entry == "rebm.eval.fid_stats":
        return [config, *overrides, chosen, "--out", str(out / "stats.npz")]
    table = _table_file(tmp, config, [*overrides, chosen])
    return [str(table), "--checkpoints", str(tmp), "--out", str(out)]


ENTRIES = ["rebm.eval.evaluate", "rebm.eval.table", "rebm.eval.fid_stats"]
# Each entry refuses either file on one process, and under torchrun (2 processes, each a new
# interpreter: the expensive case) with one line per job, the two files shared out among the
# entries: the message depends on the file and not on the process count, the one line per job on
# the entry and the launcher and not on the file.
REFUSALS = ([(entry, bad, 1) for entry in ENTRIES for bad in ("same_size", "truncated")]
            + [(entry, bad, 2) for entry, bad in zip(ENTRIES, ("same_size", "truncated",
                                                               "same_size"), strict=True)])


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("entry, bad, nproc", REFUSALS)
def test_weights_that_are_not_the_pinned_file_stop_at_start_in_one_line(setup, tmp_path, entry,
                                                                        bad, nproc):
    weights = {"same_size": setup[4], "truncated": setup[5]}[bad]
    out = tmp_path / "out"
    args = _entry_args(entry, setup, weights, out)
    cmd = [sys.executable, "-m", entry, *args] if nproc == 1 else torchrun_cmd(entry, args, 2)
    result = run_command(cmd, timeout=150, env=_env())
    assert result.returncode != 0
    errors = error_lines(result.output)
    assert len(errors) == 1, result.output[-3000:]
    found = (f"sha256 {network.file_sha256(str(weights))[:8]}..." if bad == "same_size"
             else f"{weights.stat().st_size:,} bytes")
    for words in (str(weights), PINNED, found, "image_log.unverified_inception=true"):
        assert words in errors[0], errors[0]
    assert rebm_traceback_lines(result.output) == [], result.output[-3000:]
    assert not (out / "stats.npz").exists() and not (out / "table.md").exists()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_unverified_weights_give_unverified_keys_marked_everywhere(setup, tmp_path):
    """With image_log.unverified_inception, fid_stats records the file's digest, and FID, IS and
    precision/recall come out under *_unverified only, marked on the console."""
    tmp, config, overrides, random = setup[:4]
    digest = network.file_sha256(str(random))
    chosen = [f"image_log.inception_weights={random}", "image_log.unverified_inception=true"]
    stats = tmp_path / "stats.npz"
    made = run_command([sys.executable, "-m", "rebm.eval.fid_stats", config, *overrides, *chosen,
                        "--out", str(stats), "--num-images", "16"], timeout=200, env=_env())
    made.assert_ok()
    assert "FID statistics of UNVERIFIED Inception weights" in made.output
    with np.load(stats) as npz:
        assert str(npz["features"]) == f"Inception-v3 pool3 (pytorch-fid), UNVERIFIED weights sha256 {digest}"
        assert str(npz["recipe"]).startswith("test: the stored 16 px images")
    run_dir = tmp_path / "run"
    result = run_command([sys.executable, "-m", "rebm.eval.evaluate", config, *overrides, *chosen,
                          "image_log.log_fid=true", f"image_log.data_dir={stats}",
                          "--samples", "--no-ece", "--metrics", "inception_score,precision_recall",
                          f"run_dir={run_dir}"], timeout=300, env=_env())
    result.assert_ok()
    values = json.loads(result.output.strip().splitlines()[-1])
    for key in ("fid", "inception_score", "precision", "recall"):
        assert isinstance(values[f"{key}_unverified"], float), values
        assert key not in values
    assert "FID, UNVERIFIED Inception weights" in result.output
    assert "Inception Score, UNVERIFIED Inception weights" in result.output
    with open(run_dir / "eval.json") as fh:
        settings = json.load(fh)["settings"]
    assert settings["fid"]["features"].endswith(f"UNVERIFIED weights sha256 {digest}")
    assert digest in settings["inception_score"]["features"]


def test_statistics_of_another_network_are_refused(setup, tmp_path, monkeypatch):
    """Unverified weights against the verified Inception's statistics (a file without a record,
    as pytorch-fid and the original write them), and a stand-in against those of the unverified
    weights: one line each naming both networks."""
    from rebm.config import load_config

    tmp, config, overrides, random = setup[:4]
    dims = fid.INCEPTION_DIMS
    plain = tmp_path / "plain.npz"
    np.savez(plain, mu=np.zeros(dims), sigma=np.eye(dims))
    chosen = [f"image_log.inception_weights={random}", "image_log.unverified_inception=true",
              "image_log.log_fid=true"]
    monkeypatch.delenv(network.FEATURES_ENV, raising=False)
    cfg = load_config(config, [*overrides, *chosen, f"image_log.data_dir={plain}"])
    [problem] = fid.reference_problems(cfg.evaluation)
    assert "holds statistics of Inception-v3 pool3 (pytorch-fid) features" in problem
    assert "UNVERIFIED weights sha256" in problem and "\n" not in problem
    unverified = tmp_path / "unverified.npz"
    fid.write_statistics(str(unverified), np.zeros(dims), np.eye(dims),
                         network.feature_network(cfg.image_log).describe(), "test")
    assert fid.reference_problems(load_config(
        config, [*overrides, *chosen, f"image_log.data_dir={unverified}"]).evaluation) == []
    monkeypatch.setenv(network.FEATURES_ENV, STANDIN)
    standin_stats = tmp_path / "standin.npz"
    fid.write_statistics(str(standin_stats), np.zeros(15), np.eye(15), f"stand-in {STANDIN}",
                         "test")
    assert fid.reference_problems(load_config(
        config, [*overrides, *chosen, f"image_log.data_dir={standin_stats}"]).evaluation) == []
    [problem] = fid.reference_problems(
        load_config(config, [*overrides, *chosen, f"image_log.data_dir={unverified}"]).evaluation)
    assert "UNVERIFIED" in problem and f"computes stand-in {STANDIN}" in problem


def test_a_table_gives_unverified_values_their_own_marked_column(tmp_path):
    from rebm.eval.table.report import write_report
    from rebm.eval.table.spec import RowSpec, TableSpec

    rows = [RowSpec(name="a", group="A", config="c.yaml", checkpoint="a.pth")]
    spec = TableSpec(path="t.yaml", title="t", metrics=["fid"], rows=rows,
                     columns={"fid": "FID"})
    md, _ = write_report(spec, {"a": {"fid_unverified": 12.5}}, {}, str(tmp_path))
    text = Path(md).read_text()
    assert "| FID | FID (UNVERIFIED Inception weights) |" in text
    assert "| – | 12.50 |" in text  # never under the verified FID's header


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_default_256px_statistics_are_fid_score2s_recipe(tmp_path, monkeypatch):
    """rebm's default statistics at 256 px equal those of the original's fid_score2.py recipe:
    torchvision's CenterCrop(min side) + Resize((256, 256)) on the image files, then pytorch-fid's
    own InceptionV3 (reading its hub cache) and pytorch-fid's mean and covariance."""
    import torchvision.transforms as T
    from PIL import Image
    from pytorch_fid.inception import InceptionV3

    root = write_fake_imagenet(str(tmp_path / "ImageNet"), num_classes=2, n_train=3, n_val=1,
                               height=60, width=90)
    hub = tmp_path / "torch_home"
    weights = hub / "hub" / "checkpoints" / network.INCEPTION_WEIGHTS_FILE
    weights.parent.mkdir(parents=True)
    torch.manual_seed(1)
    torch.save(random_fid_inception_state(), weights)
    config = tmp_path / "config.yaml"
    config.write_text("rand_seed: 0\n")
    out = tmp_path / "stats.npz"
    run_command([sys.executable, "-m", "rebm.eval.fid_stats", str(config),
                 "data.indist_dataset=ImageNet", f"data.indist_ds_dir={root}",
                 "data.num_classes=2", "data.image_size=256", "data.num_workers=0",
                 "image_log.unverified_inception=true", "--out", str(out)],
                timeout=300, env=_env(TORCH_HOME=str(hub))).assert_ok()

    monkeypatch.setenv("TORCH_HOME", str(hub))
    recipe = T.Compose([T.Lambda(lambda img: T.CenterCrop(min(img.size))(img)),
                        T.Resize((256, 256)), T.ToTensor()])
    files = sorted(glob.glob(os.path.join(root, "train", "*", "*.JPEG")))
    images = torch.stack([recipe(Image.open(f).convert("RGB")) for f in files])
    net = InceptionV3([InceptionV3.BLOCK_INDEX_BY_DIM[2048]]).eval()
    with torch.no_grad():
        features = net(images)[0].flatten(1).numpy().astype(np.float64)
    with np.load(out) as npz:
        assert str(npz["recipe"]).startswith("fid_score2: CenterCrop(min side) + Resize((256, 256)")
        np.testing.assert_allclose(npz["mu"], features.mean(axis=0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(npz["sigma"], np.cov(features, rowvar=False),
                                   rtol=1e-4, atol=1e-6)
