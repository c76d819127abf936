"""The registered evaluation metrics against the libraries they come from, and world-size
invariance of the streaming passes (rebm/eval/registry.py, samples.py, test_set.py).

- AutoAttack equals pyautoattack called on the same test chunks; IS (eval.is_resize=fidelity)
  and precision/recall equal torch-fidelity called on the `keep_samples` PNGs and the same real
  images (with the tests' stand-in feature network, and with torch-fidelity's Inception from a
  local random-weights file; the original's IS path is tested in test_sample_protocol.py);
- every metric gives the same numbers (and the same files) on 1, 2 and 3 ranks (real processes,
  gloo);
- `eval.image_ids` / `eval.num_images` choose the test images; unconditional samples ascend
  logsumexp; the reliability diagram is written.
The data is a tiny CIFAR-10 in the real on-disk format; the model a WideResNet-10-1 whose head is
fitted to half the test images (so accuracies and attacks mean something).
"""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import pytest
import torch

from rebm import distributed as rd
from rebm.config import load_config
from rebm.distributed import Runtime
from rebm.eval.features.fid import FEATURES_ENV
from rebm.standin.writers import write_fake_cifar10, write_fake_imagenet
from tests.helpers import REPO, base_env, run_command, torchrun_cmd
from tests.processes import spawn_ranks
from tests.standins import STANDIN, fit_head, standin_features, write_standin_statistics

N_TEST, N_TRAIN, N_SAMPLES = 21, 40, 13
SAMPLE_METRICS = ("sample_grid", "keep_samples", "samples_npz", "fid", "inception_score",
                  "precision_recall")


def _overrides(root) -> list:
    return ["data.indist_dataset=cifar10", "data.num_workers=0", "data.image_size=16",
            "data.outdist_dataset=noise", "model.model_type=WideResNet10x1",
            f"data.indist_ds_dir={root}", f"model.ckpt_path={root}/model.pth",
            "indist_attack_clf.max_steps=2", "indist_attack_clf.step_size=0.1",
            "indist_attack_clf.eps=0.3", "image_log.num_steps=2", "image_log.step_size=0.5",
            f"image_log.num_samples={N_SAMPLES}", "image_log.log_fid=true",
            f"image_log.data_dir={root}/stats.npz", "rand_seed=3"]


def _cfg(root, *extra):
    return load_config(None, [*_overrides(root), *extra])


# one torch thread in this process: the pytest workers already fill the cores
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny CIFAR-10, a model that fits half its test set, stand-in FID statistics."""
    from rebm.data.pipeline import indist_source
    from rebm.eval.features.fid import feature_statistics, to_8bit
    from rebm.models import build_model

    root = tmp_path_factory.mktemp("metrics")
    write_fake_cifar10(str(root), n_train=N_TRAIN, n_test=N_TEST)
    cfg = _cfg(root)
    test = indist_source(cfg.data, "test")
    x = test.images(np.arange(N_TEST)).float() / 255.0
    torch.manual_seed(0)
    model = build_model("WideResNet10x1", 10).eval()
    fit_head(model, x[::2], test.labels(np.arange(N_TEST))[::2])
    torch.save(model.state_dict(), root / "model.pth")
    train = indist_source(cfg.data, "train").images(np.arange(N_TRAIN)).float() / 255.0
    mu, sigma = feature_statistics(standin_features(to_8bit(train)).numpy())
    write_standin_statistics(root / "stats.npz", mu, sigma)
    (root / "config.yaml").write_text("rand_seed: 3\n")
    return root


def _real_dataset(cfg, n: int):
    """The train images rebm's precision/recall compares with, as uint8 tensors: the seeded
    class-balanced subset of n."""
    from rebm.data.pipeline import load_indist
    from rebm.eval.metric import to_pixels
    from rebm.eval.metrics.precision_recall import reference_indices

    dataset = load_indist(cfg.data, cfg.eval.pr_reference_split, "test")
    labels = np.array([dataset[i][1] for i in range(len(dataset))])
    chosen = reference_indices(labels, n, cfg.schedule.rand_seed)
    images = to_pixels(torch.stack([dataset[int(i)][0] for i in chosen]))

    class Real(torch.utils.data.Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return images[i]

    return Real()


def _torch_fidelity(folder, cfg, extractor: str, **kwargs) -> dict:
    """torch-fidelity itself: IS of the PNG folder, precision/recall against the real images."""
    import torch_fidelity

    return torch_fidelity.calculate_metrics(
        input1=str(folder), input2=_real_dataset(cfg, N_SAMPLES), isc=True, prc=True,
        feature_extractor=extractor, cuda=False, batch_size=4, verbose=False, cache=False,
        save_cpu_ram=True, **kwargs)


# --------------------------------------------------------------------------------------------
# 1, 2, 3 ranks
# --------------------------------------------------------------------------------------------
def _worker(root: str, out: str) -> None:
    from rebm.eval.evaluator import Evaluator, load_eval_model

    runtime = rd.setup_distributed()
    cfg = _cfg(root, "eval.num_images=4")
    run_dir = os.path.join(out, f"w{runtime.world_size}")
    evaluator = Evaluator(cfg.evaluation, runtime, ("accuracy", "robust_accuracy", "autoattack",
                                                    "ece", *SAMPLE_METRICS),
                          batch_size=2, run_dir=run_dir)
    model = load_eval_model(cfg.model, cfg.data, cfg.ema.use_ema, runtime)
    result = evaluator.evaluate_all_ranks(model).values
    torch.save(result, os.path.join(out, f"w{runtime.world_size}_rank{runtime.rank}.pt"))
    rd.teardown(runtime)


@pytest.fixture(scope="module")
def ranks(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    os.environ[FEATURES_ENV] = STANDIN  # inherited by the spawned ranks
    try:
        for world in (1, 2, 3):
            spawn_ranks(_worker, world, str(data), str(out))
    finally:
        del os.environ[FEATURES_ENV]
    results = {w: [torch.load(out / f"w{w}_rank{r}.pt") for r in range(w)] for w in (1, 2, 3)}
    return out, results


@pytest.mark.numbers
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_metric_and_file_identical_on_1_2_3_ranks(ranks):
    out, results = ranks
    single = results[1][0]
    assert single["n_test"] == 4 and 0 < single["test_acc"] <= 1
    assert single["autoattack_test_acc"] <= single["test_acc"]
    for key in ("fid_standin", "inception_score_standin", "precision_standin", "recall_standin"):
        assert key in single, key
    assert "fid" not in single and "inception_score" not in single  # a stand-in is labelled
    npz = np.load(out / "w1" / "samples" / "samples.npz")["arr_0"]
    assert npz.shape == (N_SAMPLES, 16, 16, 3) and npz.dtype == np.uint8
    for world in (2, 3):
        for result in results[world]:
            for key, value in single.items():
                # ECE adds the ranks' float64 sums in another order: round-off only (FID, IS
                # and precision/recall add exactly, rebm/eval/exact_sums.py: the same bits)
                if key == "ece":
                    assert result[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (world, key)
                else:
                    assert result[key] == value, (world, key)
        folder = out / f"w{world}" / "samples"
        assert np.array_equal(np.load(folder / "samples.npz")["arr_0"], npz), world
        for name in ["gen_samples.png", "seed_samples.png",
                     *(f"eval/{i}.png" for i in range(N_SAMPLES))]:
            assert (folder / name).read_bytes() == (out / "w1" / "samples" / name).read_bytes()
        assert (out / f"w{world}" / "reliability.png").is_file()
    # the npz holds the PNGs' pixels, in index order
    from PIL import Image

    png = np.array(Image.open(out / "w1" / "samples" / "eval" / "7.png"))
    assert np.array_equal(npz[7], png)


# --------------------------------------------------------------------------------------------
# The libraries, called directly
# --------------------------------------------------------------------------------------------
@pytest.mark.numbers
@pytest.mark.timeout(900)
def test_autoattack_equals_pyautoattack_on_the_same_chunks(data):
    from pyautoattack import AutoAttack

    from rebm.data.pipeline import indist_source
    from rebm.eval.evaluator import Evaluator, load_eval_model

    cfg = _cfg(data, "eval.num_images=4")
    model = load_eval_model(cfg.model, cfg.data, cfg.ema.use_ema, Runtime())
    ours = Evaluator(cfg.evaluation, Runtime(), ("autoattack",), batch_size=2).evaluate_all_ranks(
        model).values
    test = indist_source(cfg.data, "test")
    correct = 0
    for chunk in (np.arange(0, 2), np.arange(2, 4)):
        x, y = test.images(chunk).float() / 255.0, test.labels(chunk)
        attack = AutoAttack(model, norm="L2", eps=0.3, seed=3, version="standard", device="cpu")
        _, y_adv = attack.run_standard_evaluation(x, y, batch_size=2)
        correct += int((y_adv == y).sum())
    assert ours["autoattack_test_acc"] == correct / 4


@pytest.mark.numbers
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_is_and_pr_equal_torch_fidelity_on_the_sample_pngs(data, tmp_path, monkeypatch):
    """The real entry point on 2 ranks with the stand-in, then torch-fidelity itself (with the
    same stand-in registered as its feature extractor) on the PNGs keep_samples wrote."""
    from tests.standins import register_standin

    args = [str(data / "config.yaml"), *_overrides(data),
            "keep_samples=true", "robust_eval=false", "per_device_eval_batch_size=4",
            f"run_dir={tmp_path}", "eval.is_resize=fidelity", "--samples", "--no-ece",
            "--metrics", "inception_score,precision_recall"]
    env = base_env(1, {FEATURES_ENV: STANDIN, "PYTHONPATH": str(REPO)})
    result = run_command(torchrun_cmd("rebm.eval.evaluate", args, 2), timeout=300, env=env)
    ours = json.loads(result.assert_ok().output.strip().splitlines()[-1])
    monkeypatch.setenv(FEATURES_ENV, STANDIN)
    library = _torch_fidelity(tmp_path / "samples" / "eval", _cfg(data), register_standin())
    # IS: the split statistics summed over the ranks (tests/test_fidelity_sharded.py)
    assert ours["inception_score_standin"] == pytest.approx(library["inception_score_mean"],
                                                            rel=1e-13)
    assert ours["inception_score_standin_std"] == pytest.approx(library["inception_score_std"],
                                                                rel=1e-10, abs=1e-15)
    assert ours["precision_standin"] == library["precision"]
    assert ours["recall_standin"] == library["recall"]
    assert ours["settings"]["inception_score"]["splits"] == 10


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_is_and_pr_with_torch_fidelitys_inception_from_a_local_file(data, tmp_path,
                                                                     monkeypatch):
    """torch-fidelity's own Inception, built from a local weights file (random weights in
    pytorch-fid's layout: the real file is the same state dict) without any download."""
    from torch_fidelity import feature_extractor_inceptionv3 as tf_inception

    from rebm.eval.evaluator import Evaluator, load_eval_model
    from tests.standins import random_fid_inception_state

    torch.manual_seed(0)
    weights = tmp_path / "inception.pth"
    torch.save(random_fid_inception_state(), weights)
    monkeypatch.delenv(FEATURES_ENV, raising=False)

    def no_network(*args, **kwargs):
        raise AssertionError("tried to download")

    monkeypatch.setattr(tf_inception, "load_state_dict_from_url", no_network)
    # random weights are not the pinned file: accepted only as unverified, under their own keys
    cfg = _cfg(data, f"image_log.inception_weights={weights}", "eval.is_resize=fidelity",
               "image_log.unverified_inception=true")
    evaluator = Evaluator(cfg.evaluation, Runtime(),
                          ("keep_samples", "inception_score", "precision_recall"),
                          batch_size=4, run_dir=str(tmp_path))
    model = load_eval_model(cfg.model, cfg.data, cfg.ema.use_ema, Runtime())
    ours = evaluator.evaluate_all_ranks(model).values
    library = _torch_fidelity(tmp_path / "samples" / "eval", cfg, "inception-v3-compat",
                              feature_extractor_weights_path=str(weights))
    # another batch composition (torch-fidelity reads the files in name order) moves the
    # float32 Inception features by round-off only
    assert ours["inception_score_unverified"] == pytest.approx(library["inception_score_mean"],
                                                               rel=1e-5)
    assert ours["inception_score_unverified_std"] == pytest.approx(
        library["inception_score_std"], rel=1e-3, abs=1e-6)
    assert ours["precision_unverified"] == library["precision"]
    assert ours["recall_unverified"] == library["recall"]
    assert not {"inception_score", "precision", "recall"} & set(ours)


# --------------------------------------------------------------------------------------------
# Test images, unconditional samples, the diagram
# --------------------------------------------------------------------------------------------
def test_image_ids_choose_the_test_images(data, tmp_path):
    from rebm.eval.metric import EvalError
    from rebm.eval.test_set import ROBUSTBENCH_IDS, test_indices

    ids = tmp_path / "ids.txt"
    ids.write_text("# a comment\n5\n3\n\n17\n")
    assert list(test_indices(_cfg(data, f"eval.image_ids={ids}").evaluation)) == [5, 3, 17]
    assert list(test_indices(_cfg(data, f"eval.image_ids={ids}",
                                  "eval.num_images=2").evaluation)) == [5, 3]
    assert list(test_indices(_cfg(data, "eval.num_images=3").evaluation)) == [0, 1, 2]
    ids.write_text("5\n99\n")
    with pytest.raises(EvalError, match=r"index 99 is out of range: the test split has 21"):
        test_indices(_cfg(data, f"eval.image_ids={ids}").evaluation)
    with pytest.raises(EvalError, match="eval.image_ids .* cannot be read"):
        test_indices(_cfg(data, f"eval.image_ids={tmp_path / 'absent.txt'}").evaluation)
    with open(ROBUSTBENCH_IDS) as fh:
        shipped = [line.strip() for line in fh if line.strip() and not line.startswith("#")]
    assert len(shipped) == len(set(shipped)) == 5000
    assert all(line.startswith("n") and line.endswith(".JPEG") for line in shipped)


def test_image_ids_as_paths_relative_to_imagenet_val(tmp_path):
    from rebm.eval.metric import EvalError
    from rebm.eval.test_set import test_indices

    root = write_fake_imagenet(str(tmp_path / "imagenet"), num_classes=3, n_train=1, n_val=2)
    base = ["data.indist_dataset=ImageNet", f"data.indist_ds_dir={root}", "data.num_classes=3",
            "data.image_size=32", "model.model_type=TinyResNetImageNet"]
    val = sorted(os.path.relpath(os.path.join(d, f), os.path.join(root, "val"))
                 for d, _, files in os.walk(os.path.join(root, "val")) for f in files)
    ids = tmp_path / "ids.txt"
    ids.write_text(f"{val[4]}\n{val[1]}\n")
    cfg = load_config(None, [*base, f"eval.image_ids={ids}"])
    assert list(test_indices(cfg.evaluation)) == [4, 1]
    ids.write_text("n00000000/ILSVRC2012_val_99999999.JPEG\n")
    with pytest.raises(EvalError, match="1 of 1 ids are not in the test split"):
        test_indices(load_config(None, [*base, f"eval.image_ids={ids}"]).evaluation)


@pytest.mark.numbers
def test_unconditional_samples_ascend_logsumexp(data):
    from rebm.attacks.pgd import pgd_attack
    from rebm.eval.evaluator import load_eval_model
    from rebm.eval.sampling.generation import SampleGenerator, SeedImages

    cfg = _cfg(data, "eval.unconditional_samples=true")
    model = load_eval_model(cfg.model, cfg.data, cfg.ema.use_ema, Runtime())
    idx = torch.arange(5)
    source = SeedImages(cfg.image_log.seed_images, 16, cfg.schedule.rand_seed)
    samples = SampleGenerator(model, cfg.evaluation, Runtime(), source)(idx).images
    seeds = SeedImages("noise", 16, rand_seed=3)(idx)
    expected = pgd_attack(model, seeds, steps=2, step_size=0.5, eps=cfg.image_log.eps,
                          norm="L2", objective="lse")
    assert torch.equal(samples, expected)
    conditional = SampleGenerator(model, _cfg(data).evaluation, Runtime(), source)(idx).images
    assert not torch.equal(samples, conditional)
    assert torch.logsumexp(model(samples), 1).mean() > torch.logsumexp(model(seeds), 1).mean()


def test_calibration_writes_the_reliability_diagram(data, tmp_path):
    from PIL import Image

    from rebm.eval.evaluator import Evaluator, load_eval_model

    cfg = _cfg(data)
    evaluator = Evaluator(cfg.evaluation, Runtime(), ("ece",), batch_size=8, run_dir=str(tmp_path))
    model = load_eval_model(cfg.model, cfg.data, cfg.ema.use_ema, Runtime())
    eval_results = evaluator.evaluate_all_ranks(model, step=12)
    result = eval_results.values
    assert eval_results.files == {
        "reliability_diagram": str(tmp_path / "reliability_step00000012.png")}
    assert 0 <= result["ece"] <= 1 and result["n_test"] == N_TEST
    with Image.open(tmp_path / "reliability_step00000012.png") as image:
        assert image.size[0] > 100 and image.size[1] > 100


@pytest.mark.slow
def test_unknown_metric_is_a_one_line_error(data):
    args = [str(data / "config.yaml"), *_overrides(data),
            "--metrics", "inception_scor"]
    result = run_command([sys.executable, "-m", "rebm.eval.evaluate", *args], timeout=120,
                         env=base_env(1, {"PYTHONPATH": str(REPO)}))
    assert result.returncode == 2
    assert "unknown metric 'inception_scor'; the metrics are accuracy," in result.output
    assert "Traceback" not in result.output


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_console_table_and_eval_json_name_every_setting(data, tmp_path):
    """The real entry point: each value is printed with what it was computed on, and eval.json
    records the same settings next to the values; a stand-in FID is labelled (key and text)."""
    args = [str(data / "config.yaml"), *_overrides(data), "robust_eval_steps=3",
            f"run_dir={tmp_path}", "--samples", "--ood"]
    env = base_env(1, {FEATURES_ENV: STANDIN, "PYTHONPATH": str(REPO)})
    result = run_command([sys.executable, "-m", "rebm.eval.evaluate", *args], timeout=240,
                         env=env).assert_ok()
    metrics = json.loads(result.output.strip().splitlines()[-1])
    assert json.loads((tmp_path / "eval.json").read_text()) == metrics
    settings = metrics["settings"]
    assert list(settings) == ["accuracy", "robust_accuracy", "ece", "ood", "sample_grid", "fid"]
    assert settings["robust_accuracy"] | {"attack": "PGD", "norm": "L2", "eps": 0.3, "steps": 3,
                                          "step_size": 0.1} == settings["robust_accuracy"]
    assert settings["ood"]["out_distribution"] == "noise" and settings["ood"]["score"] == "lse"
    assert settings["fid"]["num_samples"] == N_SAMPLES
    assert settings["fid"]["features"] == f"stand-in {STANDIN}"
    assert "fid_standin" in metrics and "fid" not in metrics
    table = result.output[result.output.index("metric "):]
    expected = [
        f"clean accuracy .* {N_TEST} test images",
        f"robust accuracy .* PGD-3 L2 eps 0.3, step 0.1; {N_TEST} test images",
        f"calibration error \\(ECE\\) .* 20 equal-width bins of the max softmax; {N_TEST}",
        f"OOD AUROC .* vs noise \\({N_TEST} images at 16 px\\), score lse; {N_TEST} test images",
        f"FID, STAND-IN features \\(not Inception\\) .* {N_SAMPLES} conditional samples, 2 PGD "
        f"steps \\(L2, step 0.5, eps inf\\) from noise, floor pixels; vs stats.npz; stand-in "
        f"{STANDIN}",
    ]


    for line, pattern in zip(table.splitlines()[1:6], expected, strict=True):
        assert re.match(pattern, line), (line, pattern)
