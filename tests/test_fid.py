"""FID through pytorch-fid (rebm/eval/features/fid.py, fid_stats.py, sweep.py; docs/evaluation.md).

The distance is always pytorch-fid's. The feature network is Inception where its weights are on
disk; elsewhere `tests.standins.standin_features` stands in for it, named by
REBM_FID_FEATURES=rebm.eval.standin:features (in-process and in real subprocesses; its
values are stored under `fid_standin`, never as `fid`). The data is a
tiny CIFAR-10 in the real on-disk format, the model a random WideResNet-10-1.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

from rebm.config import load_config
from rebm.config.schema import ImageLogConfig
from rebm.data.indexing import eval_chunks
from rebm.distributed import Runtime
from rebm.eval.features import fid
from rebm.eval.features.network import feature_network
from rebm.standin.writers import write_fake_cifar10
from tests.helpers import REPO, base_env, run_command, torchrun_cmd
from tests.standins import (  # noqa: E402
    STANDIN,
    generate_samples,
    random_fid_inception_state,
    standin_features,
)

pytestmark = pytest.mark.numbers

OVERRIDES = [
    "data.indist_dataset=cifar10",
    "data.num_workers=0",
    "data.outdist_dataset=noise",
    "data.image_size=16",
    "model.model_type=WideResNet10x1",
    "robust_eval=false",
    "image_log.step_size=0.5",
    "image_log.num_samples=13",
    "rand_seed=3",
]


@pytest.fixture(autouse=True)
def one_thread():
    """In-process tests run on one intra-op thread: the tensors are tiny, and two threads on a
    busy 2-core machine spin-wait (50x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(tmp folder, config file, overrides) of a tiny CIFAR-10 and a random WideResNet."""
    from rebm.models import build_model

    tmp = tmp_path_factory.mktemp("fid")
    write_fake_cifar10(str(tmp), n_train=40, n_test=11)
    torch.manual_seed(0)
    torch.save(build_model("WideResNet10x1", 10).state_dict(), tmp / "model.pth")
    config = tmp / "config.yaml"
    config.write_text("rand_seed: 3\n")
    overrides = [*OVERRIDES, f"data.indist_ds_dir={tmp}", f"model.ckpt_path={tmp / 'model.pth'}"]
    return tmp, str(config), overrides


def _cfg(setup, *extra):
    return load_config(setup[1], [*setup[2], *extra])


@pytest.fixture
def standin(monkeypatch):
    """The stand-in feature network for this process (REBM_FID_FEATURES)."""
    monkeypatch.setenv(fid.FEATURES_ENV, STANDIN)


def _standin_env():
    return base_env(1, {"REBM_FID_FEATURES": STANDIN, "PYTHONPATH": str(REPO)})


def _model(cfg):
    from rebm.eval.evaluator import load_eval_model

    return load_eval_model(cfg.model, cfg.data, cfg.ema.use_ema, Runtime())


def _fid_of(images, stats_path, batch_size: int = 100) -> float:
    """FID of float [0, 1] images (floor pixels) against a statistics file, in chunks of
    `batch_size`: the scorer an evaluation's FID uses."""
    scorer = fid.FIDScorer(fid.feature_extractor("cpu", ImageLogConfig()),
                           fid.load_reference(str(stats_path)),
                           Runtime(), batch_size)
    sums = fid.MomentSums()
    for chunk in images.split(batch_size):
        scorer.add(sums, chunk)
    return scorer.score_all_ranks(sums)


# --------------------------------------------------------------------------------------------
# The distance and the statistics
# --------------------------------------------------------------------------------------------
def test_frechet_distance_is_pytorch_fids_and_matches_the_closed_form(monkeypatch):
    from pytorch_fid import fid_score

    calls = []
    library = fid_score.calculate_frechet_distance
    monkeypatch.setattr(fid_score, "calculate_frechet_distance",
                        lambda *args, **kwargs: calls.append(1) or library(*args, **kwargs))
    rng = np.random.default_rng(0)
    mu1, mu2 = rng.normal(size=6), rng.normal(size=6)
    s1, s2 = rng.uniform(0.1, 3.0, size=6), rng.uniform(0.1, 3.0, size=6)
    closed_form = np.sum((mu1 - mu2) ** 2) + np.sum(s1 + s2 - 2 * np.sqrt(s1 * s2))
    assert fid.frechet_distance(mu1, np.diag(s1), mu2, np.diag(s2)) == pytest.approx(closed_form)
    assert calls == [1]  # computed by pytorch-fid, not by a copy of our own
    with pytest.raises(ValueError, match="differ in shape"):
        fid.frechet_distance(mu1, np.diag(s1), mu2[:5], np.diag(s2[:5]))


def test_sharded_moments_equal_numpy_statistics():
    rng = np.random.default_rng(1)
    feats = torch.from_numpy(rng.normal(2.0, 0.5, size=(37, 5)))
    mu, sigma = fid.moments_statistics_all_ranks(feats.split(8), Runtime())
    ref_mu, ref_sigma = fid.feature_statistics(feats.numpy())
    np.testing.assert_allclose(mu, ref_mu, rtol=0, atol=1e-12)
    np.testing.assert_allclose(sigma, ref_sigma, rtol=0, atol=1e-12)
    # the chunks of every world size cover each index once, in the same chunks
    for world in (1, 2, 3):
        shards = [eval_chunks(37, 8, r, world) for r in range(world)]
        chunks = sorted((c.start, c.stop) for shard in shards for c in shard)
        assert chunks == [(s, min(s + 8, 37)) for s in range(0, 37, 8)]


# --------------------------------------------------------------------------------------------
# The whole path in real processes: fid_stats, then evaluate on 1 and 2 ranks
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stats_file(setup):
    """Statistics of the train split written by `torchrun -m rebm.eval.fid_stats` on 2 ranks."""
    tmp, config, overrides = setup
    out = tmp / "stats.npz"
    cmd = torchrun_cmd("rebm.eval.fid_stats", [config, *overrides, "--out", str(out),
                                               "--split", "train"], nproc=2)
    result = run_command(cmd, timeout=120, env=_standin_env()).assert_ok()
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["num_images"] == 40 and summary["world_size"] == 2
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fid_stats_on_2_ranks_equal_one_process_and_load_in_pytorch_fid(setup, stats_file,
                                                                         standin):
    from rebm.data import load_indist
    from rebm.eval.commands.fid_stats import dataset_statistics_all_ranks

    cfg = _cfg(setup)
    with np.load(stats_file) as stats:  # what pytorch-fid reads
        mu, sigma = stats["mu"], stats["sigma"]
    images = torch.stack([load_indist(cfg.data, "train")[i][0] for i in range(40)])
    ref_mu, ref_sigma = fid.feature_statistics(standin_features(images).numpy())
    np.testing.assert_allclose(mu, ref_mu, rtol=0, atol=1e-12)
    np.testing.assert_allclose(sigma, ref_sigma, rtol=0, atol=1e-12)
    one_mu, one_sigma, n, _ = dataset_statistics_all_ranks(cfg.evaluation, Runtime(), "train",
                                                           num_images=40, batch_size=7)
    assert n == 40
    np.testing.assert_allclose(one_mu, mu, rtol=0, atol=1e-12)
    np.testing.assert_allclose(one_sigma, sigma, rtol=0, atol=1e-12)


def _evaluate(setup, stats, nproc: int, run_dir):
    tmp, config, overrides = setup
    args = [config, *overrides, "image_log.log_fid=true", f"image_log.data_dir={stats}",
            "image_log.num_steps=2", "image_log.adaptive_steps=true", "image_log.sweep_radius=1",
            "image_log.sweep_num_samples=12", "keep_samples=true", f"run_dir={run_dir}",
            "--samples", "--no-ece"]
    module = "rebm.eval.evaluate"
    cmd = [sys.executable, "-m", module, *args] if nproc == 1 else torchrun_cmd(module, args, 2)
    result = run_command(cmd, timeout=120, env=_standin_env()).assert_ok()
    return json.loads(result.output.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fid_with_sweep_identical_on_1_and_2_ranks(setup, stats_file, tmp_path, standin):
    one = _evaluate(setup, stats_file, 1, tmp_path / "w1")
    two = _evaluate(setup, stats_file, 2, tmp_path / "w2")
    sweep = {int(k.split("/")[1]): v for k, v in one.items()
             if k.startswith("fid_standin_sweep/")}
    assert sorted(sweep) == [1, 2, 3]
    assert one["fid_standin_best_steps"] == min(sweep, key=sweep.get)
    assert np.isfinite(one["fid_standin"]) and one["fid_standin"] > 0 and "fid" not in one
    assert one["settings"]["fid"]["features"] == f"stand-in {STANDIN}"
    assert two["world_size"] == 2
    assert two["fid_standin_best_steps"] == one["fid_standin_best_steps"]
    for key in ("fid_standin", *(f"fid_standin_sweep/{s}" for s in sweep)):
        assert two[key] == pytest.approx(one[key], rel=1e-9, abs=1e-9), key
    # keep_samples: every sample as a PNG; they are exactly what the FID was computed on
    for run_dir, metrics in ((tmp_path / "w1", one), (tmp_path / "w2", two)):
        files = sorted(os.listdir(run_dir / "samples" / "eval"), key=lambda f: int(f[:-4]))
        assert files == [f"{i}.png" for i in range(13)]
        from PIL import Image

        pngs = torch.stack([torch.from_numpy(np.array(Image.open(run_dir / "samples" / "eval" / f)))
                            for f in files]).permute(0, 3, 1, 2).float() / 255
        again = _fid_of(pngs, stats_file)
        assert again == pytest.approx(metrics["fid_standin"], rel=1e-9)


# --------------------------------------------------------------------------------------------
# The adaptive sweep
# --------------------------------------------------------------------------------------------
def test_sweep_candidates():
    from rebm.eval.sampling.sweep import sweep_candidates

    cfg = load_config(None, ["image_log.num_steps=2", "image_log.sweep_radius=3"])
    assert sweep_candidates(cfg.image_log) == [1, 2, 3, 4, 5]  # clipped at 1, no repeats
    cfg = load_config(None, ["image_log.step_sweep_range=[30,5,10,5]"])
    assert sweep_candidates(cfg.image_log) == [5, 10, 30]


@pytest.mark.timeout(60)
def test_sweep_picks_the_step_count_with_the_lowest_fid(setup, tmp_path, standin):
    from rebm.eval.evaluator import Evaluator

    ref = tmp_path / "ref.npz"
    cfg_overrides = ["image_log.log_fid=true", f"image_log.data_dir={ref}",
                     "image_log.adaptive_steps=true", "image_log.num_steps=2",
                     "image_log.sweep_radius=2", "image_log.sweep_num_samples=20",
                     "image_log.num_samples=30", "image_log.step_size=3.0", "keep_samples=true"]
    cfg = _cfg(setup, *cfg_overrides)
    model, runtime = _model(cfg), Runtime()
    # The reference is the sweep's own samples at 4 steps, so 4 steps has FID 0 and must win,
    # at the edge of the candidates 1..4 (2 - 2 is clipped to 1).
    at_4 = load_config(setup[1], [*setup[2], *cfg_overrides, "image_log.num_steps=4"])
    images, _ = generate_samples(model, at_4, runtime, num_samples=20, batch_size=8)
    mu, sigma = fid.feature_statistics(standin_features(fid.to_8bit(images, "floor")))
    fid.write_statistics(str(ref), mu, sigma, f"stand-in {STANDIN}", "the sweep's own samples")
    evaluator = Evaluator(cfg.evaluation, runtime, ("sample_grid", "keep_samples", "fid"),
                          batch_size=8, run_dir=str(tmp_path))
    eval_results = evaluator.evaluate_all_ranks(model, step=7)
    metrics = eval_results.values
    sweep = {s: metrics[f"fid_standin_sweep/{s}"] for s in (1, 2, 3, 4)}
    assert metrics["fid_standin_best_steps"] == 4
    assert sweep[4] == pytest.approx(0.0, abs=1e-6)
    assert min(sweep[s] for s in (1, 2, 3)) > 1e-3
    # the reported fid is of num_samples samples at the chosen step count
    final, _ = generate_samples(model, at_4, runtime, num_samples=30, batch_size=8)
    assert final.shape[0] == 30
    kept = tmp_path / "samples" / "step_00000007"
    assert sorted(os.listdir(kept)) == sorted(f"{i}.png" for i in range(30))
    grid = tmp_path / "samples" / "gen_samples_step00000007.png"
    seeds = tmp_path / "samples" / "seed_samples_step00000007.png"
    assert eval_results.files == {"sample_grid": str(grid), "seed_grid": str(seeds),
                                "samples": str(kept)}
    assert grid.is_file()
    assert metrics["fid_standin"] == pytest.approx(_fid_of(final, ref, batch_size=8),
                                                   rel=1e-12)


# --------------------------------------------------------------------------------------------
# Missing pieces: one line, at the start
# --------------------------------------------------------------------------------------------
@pytest.fixture
def empty_hub(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    monkeypatch.delenv(fid.FEATURES_ENV, raising=False)
    return tmp_path / "torch_home" / "hub" / "checkpoints" / fid.INCEPTION_WEIGHTS_FILE


def _evaluator(cfg):
    """The Evaluator of a training run of `cfg` (its standard metrics, with samples)."""
    from rebm.eval.evaluator import Evaluator
    from rebm.eval.registry import standard_metrics

    return Evaluator(cfg.evaluation, Runtime(), standard_metrics(cfg.evaluation, samples=True))


def _one_line_error(cfg) -> str:
    from rebm.eval.metric import EvalError

    with pytest.raises(EvalError) as info:
        _evaluator(cfg).start_all_ranks()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_weights_and_statistics_are_one_line_naming_path_and_key(setup, empty_hub,
                                                                          tmp_path, monkeypatch):
    stats = tmp_path / "stats.npz"
    np.savez(stats, mu=np.zeros(fid.INCEPTION_DIMS), sigma=np.eye(fid.INCEPTION_DIMS))
    message = _one_line_error(_cfg(setup, "image_log.log_fid=true", f"image_log.data_dir={stats}"))
    assert str(empty_hub) in message and "image_log.inception_weights" in message
    absent = tmp_path / "absent.pth"
    message = _one_line_error(_cfg(setup, "image_log.log_fid=true", f"image_log.data_dir={stats}",
                                   f"image_log.inception_weights={absent}"))
    assert str(absent) in message and "image_log.inception_weights" in message
    # without log_fid nothing is needed; a stand-in needs no Inception weights
    assert _evaluator(_cfg(setup, f"image_log.data_dir={tmp_path / 'none.npz'}")).problems() == []
    monkeypatch.setenv(fid.FEATURES_ENV, STANDIN)
    fid.write_statistics(str(stats), np.zeros(15), np.eye(15), f"stand-in {STANDIN}", "test")
    assert _evaluator(_cfg(setup, "image_log.log_fid=true",
                           f"image_log.data_dir={stats}")).problems() == []


@pytest.mark.parametrize("content, words", [
    (None, ["does not exist", "rebm.eval.fid_stats"]),
    (b"not a zip file", ["is not a .npz with mu and sigma"]),
    ({"mean": np.zeros(3)}, ["is not a .npz with mu and sigma"]),
    ({"mu": np.zeros(3), "sigma": np.eye(3)}, ["expected (2048,) and (2048, 2048)"]),
])
def test_bad_statistics_file_is_one_line_naming_path_and_key(setup, tmp_path, monkeypatch,
                                                              content, words):
    weights = tmp_path / "weights.pth"
    weights.write_bytes(b"")  # present and accepted as unverified: only the statistics are wrong
    path = tmp_path / "stats.npz"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        np.savez(path, **content)
    cfg = _cfg(setup, "image_log.log_fid=true", f"image_log.data_dir={path}",
               f"image_log.inception_weights={weights}", "image_log.unverified_inception=true")
    monkeypatch.delenv(fid.FEATURES_ENV, raising=False)
    message = _one_line_error(cfg)
    assert str(path) in message and "image_log.data_dir" in message
    assert all(word in message for word in words), message
    unset = _one_line_error(_cfg(setup, "image_log.log_fid=true",
                                 f"image_log.inception_weights={weights}",
                                 "image_log.unverified_inception=true"))
    assert "image_log.data_dir" in unset and "is not set" in unset


def test_entry_points_fail_at_start_with_one_line(setup, empty_hub, capsys, tmp_path):
    from rebm.eval import evaluate, fid_stats

    _, config, overrides = setup
    stats = tmp_path / "no_stats.npz"
    absent_ckpt = tmp_path / "absent.pth"  # FID is checked first: this error never comes
    with pytest.raises(SystemExit) as info:
        evaluate.main([config, *overrides, f"model.ckpt_path={absent_ckpt}",
                       "image_log.log_fid=true", f"image_log.data_dir={stats}", "--samples"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(stats) in err[0] and str(empty_hub) in err[0], err
    # --check lists the same problems as warnings and exits 0
    assert evaluate.main([config, *overrides, "image_log.log_fid=true",
                          f"image_log.data_dir={stats}", "--samples", "--check"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warned) == 2 and str(empty_hub) in warned[0] and str(stats) in warned[1], warned
    with pytest.raises(SystemExit) as info:
        fid_stats.main([config, *overrides, "--out", str(tmp_path / "s.npz")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(empty_hub) in err[0], err
    assert not (tmp_path / "s.npz").exists()


# --------------------------------------------------------------------------------------------
# The Inception path
# --------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_inception_from_a_local_file_never_downloads(empty_hub, tmp_path, monkeypatch):
    import urllib.request

    from pytorch_fid import inception as pf

    torch.manual_seed(0)
    empty_hub.parent.mkdir(parents=True)
    torch.save(random_fid_inception_state(), empty_hub)
    configured = tmp_path / "elsewhere.pth"
    configured.write_bytes(empty_hub.read_bytes())

    def no_network(*args, **kwargs):
        raise AssertionError("tried to download")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    monkeypatch.setattr(pf, "load_state_dict_from_url", no_network)
    monkeypatch.setattr(fid, "_INCEPTION", {})
    image = torch.rand(1, 3, 16, 16)
    features = fid.feature_extractor("cpu", ImageLogConfig(unverified_inception=True))(image)
    assert features.shape == (1, fid.INCEPTION_DIMS) and torch.isfinite(features).all()
    ours = fid.inception_network(str(empty_hub)).state_dict()
    elsewhere = feature_network(ImageLogConfig(inception_weights=str(configured),
                                               unverified_inception=True))
    assert elsewhere.weights == str(configured) and elsewhere.kind == "unverified"
    from_path = fid.inception_network(elsewhere.weights).state_dict()
    assert pf.load_state_dict_from_url is no_network  # restored after each construction
    # The network is pytorch-fid's own InceptionV3 reading its hub cache, to the bit (the same
    # class, so the same forward; pytorch-fid's resize and scaling included).
    monkeypatch.undo()
    monkeypatch.setenv("TORCH_HOME", str(empty_hub.parents[2]))
    library = pf.InceptionV3([3]).eval()
    for name, value in library.state_dict().items():
        assert torch.equal(ours[name], value) and torch.equal(from_path[name], value), name
    assert ours.keys() == library.state_dict().keys()
    broken = tmp_path / "broken.pth"
    broken.write_bytes(b"truncated")
    with pytest.raises(fid.FIDError, match="cannot be loaded"):
        fid.inception_network(str(broken))


@pytest.mark.timeout(300)
def test_real_inception_weights_when_present():
    path = fid.hub_weights_path()
    if not os.path.isfile(path):
        pytest.skip(f"no {fid.INCEPTION_WEIGHTS_FILE} in {os.path.dirname(path)}")
    torch.manual_seed(0)
    images = torch.rand(8, 3, 32, 32)
    features = fid.feature_extractor("cpu", ImageLogConfig())
    sums = fid.MomentSums()
    fid.FIDScorer(features, (np.zeros(2048), np.eye(2048)), Runtime(), 4).add(sums, images)
    mu, sigma = sums.statistics_all_ranks(Runtime())
    assert mu.shape == (2048,) and sigma.shape == (2048, 2048)
    assert fid.frechet_distance(mu, sigma, mu, sigma) == pytest.approx(0.0, abs=1e-3)
    other = fid.MomentSums()
    fid.FIDScorer(features, (mu, sigma), Runtime(), 4).add(other, torch.rand(8, 3, 32, 32))
    assert fid.FIDScorer(features, (mu, sigma), Runtime(), 4).score_all_ranks(other) > 1.0
