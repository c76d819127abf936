"""The sample metrics follow the original DAT code's protocol by default (issue 28;
rebm/eval/metric.py `to_pixels`, generation.py, inception_score.py, precision_recall.py).

- pixels: floor(255 x), byte for byte what torchvision's `to_pil_image` writes (the original's
  sample PNGs), in every sample file and in FID's features; `eval.sample_pixels=round` keeps
  save_image's rounding;
- Inception Score: the original's path (PNG -> torchvision Resize((299, 299)) on the PIL image ->
  torch-fidelity's Inception as torchmetrics' InceptionScore wraps it -> torchmetrics' split
  statistics) on a random-weights Inception file;
- logsumexp_sampling makes the samples unconditional; seeds are unblurred unless
  image_log.blur_fid_seeds; a seed folder is read as the original's ImageFolder + Resize((S, S));
- the metrics name their files and say which protocol ran.
The data is a tiny CIFAR-10 in the real on-disk format, the model a random WideResNet-10-1.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from rebm.config import load_config
from rebm.config.schema import ImageLogConfig
from rebm.distributed import Runtime
from rebm.eval.features.fid import FEATURES_ENV
from rebm.standin.writers import write_fake_cifar10, write_fake_imagenet
from tests.standins import (
    STANDIN,
    random_fid_inception_state,
    standin_features,
    write_standin_statistics,
)

N_SAMPLES = 12


# one torch thread in this process: the pytest workers already fill the cores
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.numbers]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny CIFAR-10, a random WideResNet-10-1, stand-in FID statistics."""
    from rebm.data.pipeline import indist_source
    from rebm.eval.features.fid import feature_statistics
    from rebm.models import build_model

    root = tmp_path_factory.mktemp("protocol")
    write_fake_cifar10(str(root), n_train=30, n_test=10)
    torch.manual_seed(0)
    torch.save(build_model("WideResNet10x1", 10).state_dict(), root / "model.pth")
    train = indist_source(_cfg(root).data, "train").images(np.arange(30)).float() / 255.0
    mu, sigma = feature_statistics(standin_features(train).numpy())
    write_standin_statistics(root / "stats.npz", mu, sigma)
    return root


def _cfg(root, *extra):
    return load_config(None, [
        "data.indist_dataset=cifar10", "data.num_workers=0", "data.image_size=16",
        "data.outdist_dataset=noise", "model.model_type=WideResNet10x1",
        f"data.indist_ds_dir={root}", f"model.ckpt_path={root}/model.pth",
        "image_log.num_steps=2", "image_log.step_size=0.5", f"image_log.num_samples={N_SAMPLES}",
        "image_log.log_fid=true", f"image_log.data_dir={root}/stats.npz", "rand_seed=3", *extra])


def _evaluate(cfg, metrics, run_dir=None, batch_size=5):
    from rebm.eval.evaluator import Evaluator, load_eval_model

    evaluator = Evaluator(cfg.evaluation, Runtime(), tuple(metrics), batch_size=batch_size,
                          run_dir=None if run_dir is None else str(run_dir))
    model = load_eval_model(cfg.model, cfg.data, cfg.ema.use_ema, Runtime())
    return evaluator.evaluate_all_ranks(model).values


def _samples(cfg):
    from rebm.eval.evaluator import load_eval_model
    from tests.standins import generate_samples

    model = load_eval_model(cfg.model, cfg.data, cfg.ema.use_ema, Runtime())
    return generate_samples(model, cfg, Runtime(), batch_size=5)[0]


def _png(path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


# --------------------------------------------------------------------------------------------
# Pixels
# --------------------------------------------------------------------------------------------
def test_to_pixels_floor_is_to_pil_image_and_round_is_save_image(tmp_path):
    from torchvision.transforms.functional import to_pil_image
    from torchvision.utils import save_image

    from rebm.eval.metric import to_pixels

    torch.manual_seed(0)
    images = torch.rand(4, 3, 9, 7)
    images[0, 0, 0, :5] = torch.tensor([0.0, 1.0, 0.5, 254.5 / 255, 1 / 255])  # edges
    floor = to_pixels(images, "floor")
    for image, pixels in zip(images, floor, strict=True):
        path = tmp_path / "pil.png"
        to_pil_image(image).save(path)
        assert np.array_equal(_png(path), pixels.permute(1, 2, 0).numpy())
    assert int(floor[0, 0, 0, 3]) == 254 and int(to_pixels(images, "round")[0, 0, 0, 3]) == 255
    for image, pixels in zip(images, to_pixels(images, "round"), strict=True):
        save_image(image, tmp_path / "saved.png")
        assert np.array_equal(_png(tmp_path / "saved.png"), pixels.permute(1, 2, 0).numpy())
    eight_bit = torch.arange(256, dtype=torch.uint8)  # k / 255 comes back as k either way
    for mode in ("floor", "round"):
        assert torch.equal(to_pixels(eight_bit.float().div(255), mode), eight_bit)
    # outside [0, 1] the cast is undefined for to_pil_image; rebm clamps
    assert to_pixels(torch.tensor([-0.2, 1.3]), "floor").tolist() == [0, 255]
    with pytest.raises(ValueError, match="pixel mode 'ceil'"):
        to_pixels(images, "ceil")


def test_sample_files_and_fid_see_to_pil_image_pixels(data, tmp_path, monkeypatch):
    """keep_samples PNGs and the npz hold floor pixels, byte for byte those to_pil_image
    writes of the same float samples (the original's PNGs), and the grid is the original's
    normalised grid of them; FID's features are those of these PNGs as pytorch-fid reads them;
    round mode gives save_image's values."""
    from pytorch_fid.fid_score import ImagePathDataset
    from torchvision.transforms import ToTensor
    from torchvision.transforms.functional import to_pil_image
    from torchvision.utils import make_grid

    from rebm.eval.features.fid import feature_statistics, frechet_distance, load_reference

    monkeypatch.setenv(FEATURES_ENV, STANDIN)
    cfg = _cfg(data, "keep_samples=true")
    ours = _evaluate(cfg, ("sample_grid", "keep_samples", "samples_npz", "fid"), tmp_path)
    floats = _samples(cfg)
    originals = tmp_path / "original"
    originals.mkdir()
    for i, image in enumerate(floats):
        to_pil_image(image).save(originals / f"{i:06d}.png")  # the original's save_image
    npz = np.load(tmp_path / "samples" / "samples.npz")["arr_0"]
    for i in range(N_SAMPLES):
        expected = _png(originals / f"{i:06d}.png")
        assert np.array_equal(_png(tmp_path / "samples" / "eval" / f"{i}.png"), expected), i
        assert np.array_equal(npz[i], expected), i
    # each class's samples in turn, 10 a row (tests/test_seed_grid.py)
    shown = floats[[0, 10, 1, 11, *range(2, 10)]]
    expected = to_pil_image(make_grid(shown, nrow=10, padding=1, normalize=True))
    assert np.array_equal(_png(tmp_path / "samples" / "gen_samples.png"), np.asarray(expected))
    files = sorted(str(originals / name) for name in os.listdir(originals))
    read = torch.stack(list(ImagePathDataset(files, transforms=ToTensor())))
    expected = frechet_distance(*feature_statistics(standin_features(read).numpy()),
                                *load_reference(str(data / "stats.npz")))
    assert ours["fid_standin"] == pytest.approx(expected, rel=1e-9)
    rounded = _evaluate(_cfg(data, "eval.sample_pixels=round"), ("fid",))
    assert rounded["fid_standin"] != ours["fid_standin"]


# --------------------------------------------------------------------------------------------
# Inception Score: the original's path
# --------------------------------------------------------------------------------------------
def _original_inception_score(folder, weights, seed: int):
    """The original's compute_inception_score on a folder of PNGs, with torchmetrics'
    InceptionScore spelled out (torchmetrics is not installed here): the network is the one it
    builds (torch-fidelity's inception-v3-compat, feature logits_unbiased, forward reshaped to
    (N, -1)), its compute is torchmetrics' with the global generator seeded by `seed`."""
    from PIL import Image
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
    from torchvision import transforms

    paths = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".png"))
    transform = transforms.Compose([transforms.Resize((299, 299)), transforms.ToTensor(),
                                    transforms.Lambda(lambda x: (x * 255).to(torch.uint8))])
    batch = torch.stack([transform(Image.open(p).convert("RGB")) for p in paths])
    net = FeatureExtractorInceptionV3("inception-v3-compat", ["logits_unbiased"],
                                      feature_extractor_weights_path=str(weights)).eval()
    with torch.no_grad():
        features = torch.cat([net(part)[0].reshape(part.shape[0], -1)
                              for part in batch.split(4)])
    torch.manual_seed(seed)  # torchmetrics draws torch.randperm from the global generator
    features = features[torch.randperm(features.shape[0])]
    prob, log_prob = features.softmax(dim=1), features.log_softmax(dim=1)
    kl = torch.stack([(p * (lp - p.mean(dim=0, keepdim=True).log())).sum(dim=1).mean().exp()
                      for p, lp in zip(prob.chunk(10), log_prob.chunk(10), strict=True)])
    return float(kl.mean()), float(kl.std()), len(prob.chunk(10))


def _spread_inception_weights(path):
    """A random-weights Inception file whose logits differ between images: random weights give
    nearly the same tiny pool features (~1e-7) for every image, so the head is projected off
    their mean and scaled to logits of spread ~3 (else every score is 1.000)."""
    from rebm.eval.features.fidelity import build_extractor
    from rebm.eval.metrics.inception_score import pil_resize

    torch.manual_seed(0)
    state = random_fid_inception_state()
    torch.save(state, path)
    probe = pil_resize(torch.randint(0, 256, (6, 3, 16, 16), dtype=torch.uint8))
    extractor = build_extractor(ImageLogConfig(inception_weights=str(path),
                                               unverified_inception=True), "cpu")
    with torch.no_grad():
        pool = extractor.convert_features_tuple_to_dict(extractor(probe))["2048"].double()
    mean = pool.mean(0)
    head = state["fc.weight"].double()
    head = head - (head @ mean)[:, None] * mean[None, :] / (mean @ mean)
    state["fc.weight"] = (head * (3.0 / ((pool - mean) @ head.T).std())).float()
    torch.save(state, path)
    return path


@pytest.mark.timeout(600)
def test_inception_score_is_the_originals_path(data, tmp_path, monkeypatch):
    from torch_fidelity import feature_extractor_inceptionv3 as tf_inception
    from torchvision.transforms.functional import to_pil_image

    weights = _spread_inception_weights(tmp_path / "inception.pth")
    monkeypatch.delenv(FEATURES_ENV, raising=False)

    def no_network(*args, **kwargs):
        raise AssertionError("tried to download")

    monkeypatch.setattr(tf_inception, "load_state_dict_from_url", no_network)
    # random weights: accepted as unverified, their values under *_unverified keys
    unverified = "image_log.unverified_inception=true"
    cfg = _cfg(data, f"image_log.inception_weights={weights}", unverified)
    assert cfg.eval.is_resize == "pil"
    ours = _evaluate(cfg, ("inception_score",))
    folder = tmp_path / "original"
    folder.mkdir()
    for i, image in enumerate(_samples(cfg)):
        to_pil_image(image).save(folder / f"{i:06d}.png")
    mean, std, splits = _original_inception_score(folder, weights, cfg.schedule.rand_seed)
    assert splits == 6  # torch.chunk of 12 rows into 10 gives 6 splits of 2
    assert mean > 1.2 and std > 0
    # other batches (5 here, 4 there) move the float32 Inception logits by round-off only
    assert ours["inception_score_unverified"] == pytest.approx(mean, rel=1e-5)
    assert ours["inception_score_unverified_std"] == pytest.approx(std, rel=1e-3, abs=1e-6)
    native = _evaluate(_cfg(data, f"image_log.inception_weights={weights}", unverified,
                            "eval.is_resize=fidelity"), ("inception_score",))
    assert native["inception_score_unverified"] != pytest.approx(mean, rel=1e-5)


# --------------------------------------------------------------------------------------------
# Sampling decisions: logsumexp_sampling, blur, seed folders
# --------------------------------------------------------------------------------------------
def original_samples(model, seeds, labels, steps, step_size):
    """The original's class-conditional sampling written out: its `generate_images` ->
    `pgd_attack` (rebm/attacks/adv_attacks.py:54-112 at fb2ffc7: the model in eval mode, the
    gradient of the summed f_y, no random start) with the L2 step and projection of
    rebm/attacks/attack_steps.py:141-155 at eps = inf: x + g / (||g|| + 1e-10) * a, then
    clamp(x0 + renorm(x - x0), 0, 1)."""
    x0 = seeds.clone().detach()
    x = seeds
    for _ in range(steps):
        x = x.clone().detach().requires_grad_(True)
        loss = model(x)[torch.arange(len(x)), labels].sum()
        (grad,) = torch.autograd.grad(loss, [x])
        with torch.no_grad():
            g_norm = torch.norm(grad.reshape(grad.shape[0], -1), dim=1).reshape(-1, 1, 1, 1)
            x = x + grad / (g_norm + 1e-10) * step_size
            diff = (x - x0).renorm(p=2, dim=0, maxnorm=float("inf"))
            x = torch.clamp(x0 + diff, 0, 1)
    return x.detach()


def test_40_step_samples_are_the_originals_formulas_bit_for_bit(data):
    """rebm's class-conditional samples, 40 steps of 1.0 from the same seeds and weights, equal
    the original's formulas written out, to the bit, on this machine (the same model object, so
    the same kernels: what is compared is the step and projection arithmetic; written as
    g * (a / ||g||) with a bare clamp, 3 of 40 such samples came out visibly different,
    docs/performance.md)."""
    from rebm.eval.evaluator import load_eval_model
    from rebm.eval.passes import eval_mode
    from rebm.eval.sampling.generation import balanced_labels
    from rebm.eval.sampling.samples import seed_source
    from tests.standins import generate_samples

    cfg = _cfg(data, "image_log.num_steps=40", "image_log.step_size=1.0")
    model = load_eval_model(cfg.model, cfg.data, cfg.ema.use_ema, Runtime())
    samples, labels = generate_samples(model, cfg, Runtime(), batch_size=N_SAMPLES)
    seeds = seed_source(cfg.evaluation, {})(torch.arange(N_SAMPLES))
    assert torch.equal(labels, balanced_labels(torch.arange(N_SAMPLES), 10))
    with eval_mode(model):
        expected = original_samples(model, seeds, labels, steps=40, step_size=1.0)
    assert torch.equal(samples, expected)
    assert (samples - seeds).abs().max() > 0.1  # the samples moved


def test_logsumexp_sampling_makes_the_samples_unconditional(data, caplog):
    from rebm.eval.sampling import generation
    from rebm.eval.sampling.samples import sample_settings

    generation._NOTICES.clear()
    with caplog.at_level(logging.INFO, logger="rebm"):
        lse = _samples(_cfg(data, "logsumexp_sampling=true"))
        again = _samples(_cfg(data, "logsumexp_sampling=true"))
    unconditional = _samples(_cfg(data, "eval.unconditional_samples=true"))
    conditional = _samples(_cfg(data))
    assert torch.equal(lse, unconditional) and torch.equal(again, lse)
    assert not torch.equal(lse, conditional)
    overruled = _cfg(data, "logsumexp_sampling=true", "eval.unconditional_samples=false")
    assert torch.equal(_samples(overruled), conditional)
    # once per process, however many evaluations (the overruled case has a notice of its own)
    notices = [r.message for r in caplog.records
               if r.message.startswith("samples are unconditional")]
    assert len(notices) == 1 and "logsumexp_sampling=true" in notices[0]
    # the settings (and so the table's cache keys) say what the samples are, not which key
    # decided it: the same samples, the same settings
    settings = sample_settings(_cfg(data, "logsumexp_sampling=true").evaluation)
    assert not settings["conditional"]
    assert settings == sample_settings(_cfg(data, "eval.unconditional_samples=true").evaluation)
    assert sample_settings(overruled.evaluation)["conditional"]


def test_seeds_are_unblurred_unless_blur_fid_seeds(data):
    from rebm.eval.sampling.generation import SeedImages, blur_kernel_size
    from rebm.eval.sampling.samples import seed_source

    idx = torch.arange(6)
    plain = SeedImages("noise", 16, rand_seed=3)(idx)
    kept = _cfg(data, "image_log.blur_kernel_size=5", "image_log.adaptive_blur=true")
    assert blur_kernel_size(kept.evaluation) == 3  # 5 at 32 px, scaled to 16 px
    assert torch.equal(seed_source(kept.evaluation, {})(idx), plain)
    blurred = _cfg(data, "image_log.blur_kernel_size=5", "image_log.blur_fid_seeds=true")
    expected = SeedImages("noise", 16, rand_seed=3, blur_kernel_size=5)(idx)
    assert torch.equal(seed_source(blurred.evaluation, {})(idx), expected)
    assert not torch.equal(expected, plain)


def test_seed_folder_is_read_as_the_originals_imagefolder(tmp_path):
    from PIL import Image
    from torchvision import datasets, transforms

    from rebm.eval.sampling.generation import SeedImages

    rng = np.random.default_rng(0)
    for name, (h, w) in {"a/2.png": (20, 31), "a/10.png": (16, 16), "b/x.jpg": (40, 25),
                         "b/y.png": (9, 12)}.items():
        os.makedirs(tmp_path / "seeds" / os.path.dirname(name), exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
            tmp_path / "seeds" / name)
    original = datasets.ImageFolder(str(tmp_path / "seeds"), transform=transforms.Compose(
        [transforms.Resize((16, 16)), transforms.ToTensor()]))
    expected = torch.stack([original[i][0] for i in range(len(original))])
    seeds = SeedImages(str(tmp_path / "seeds"), 16, rand_seed=0)(torch.arange(6))
    assert torch.equal(seeds[:4], expected)
    assert torch.equal(seeds[4:], expected[:2])  # fewer seeds than samples: cycled


# --------------------------------------------------------------------------------------------
# Precision/recall references
# --------------------------------------------------------------------------------------------
def test_pr_reference_covers_every_class_of_a_class_sorted_split(tmp_path):
    from rebm.eval.metrics.precision_recall import _Reference, reference_indices

    root = write_fake_imagenet(str(tmp_path / "imagenet"), num_classes=5, n_train=6, n_val=1,
                               height=20, width=20)
    base = ["data.indist_dataset=ImageNet", f"data.indist_ds_dir={root}", "data.num_classes=5",
            "data.image_size=16", "model.model_type=TinyResNetImageNet", "data.num_workers=0",
            "image_log.num_samples=12"]
    reference = _Reference(load_config(None, [*base, "rand_seed=3"]))
    labels = reference.dataset.source.labels(np.arange(30)).numpy()
    assert list(labels) == sorted(labels) and set(labels[:12]) == {0, 1}  # first N: 2 classes
    assert np.bincount(labels[reference.indices], minlength=5).tolist() == [3, 3, 2, 2, 2]
    other = _Reference(load_config(None, [*base, "rand_seed=4"]))
    assert list(other.indices) != list(reference.indices)
    assert torch.equal(reference.images(range(2)).float().div(255),
                       torch.stack([reference.dataset[int(i)][0] for i in reference.indices[:2]]))
    # ImageNet's 1000 sorted classes: 50 000 reference images are 50 of every class
    sorted_labels = np.repeat(np.arange(1000), 1300)
    chosen = reference_indices(sorted_labels, 50000, seed=0)
    assert (np.bincount(sorted_labels[chosen], minlength=1000) == 50).all()
    short = reference_indices(np.array([0] * 2 + [1] * 20 + [2] * 20), 12, seed=0)
    assert np.bincount(np.array([0] * 2 + [1] * 20 + [2] * 20)[short]).tolist() == [2, 5, 5]


class _Images(torch.utils.data.Dataset):
    """uint8 NHWC rows as the uint8 CHW tensors torch-fidelity takes."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return torch.from_numpy(self.rows[i]).permute(2, 0, 1).contiguous()


def test_pr_reference_npz_is_read_and_checked(data, tmp_path, monkeypatch):
    import torch_fidelity

    from rebm.eval.metric import EvalError
    from rebm.eval.metrics.precision_recall import PrecisionRecall, open_reference_batch
    from tests.standins import register_standin

    monkeypatch.setenv(FEATURES_ENV, STANDIN)
    images = np.random.default_rng(0).integers(0, 256, (9, 16, 16, 3), dtype=np.uint8)
    stored, packed = tmp_path / "ref.npz", tmp_path / "packed.npz"
    np.savez(stored, arr_0=images, arr_1=np.arange(9))  # OpenAI's batches carry labels too
    np.savez_compressed(packed, arr_0=images)
    assert isinstance(open_reference_batch(str(stored), 16), np.memmap)
    for path in (stored, packed):
        assert np.array_equal(np.asarray(open_reference_batch(str(path), 16)), images)
    cfg = _cfg(data, f"eval.pr_reference={stored}", "keep_samples=true")
    ours = _evaluate(cfg, ("keep_samples", "precision_recall"), tmp_path / "run")
    library = torch_fidelity.calculate_metrics(
        input1=str(tmp_path / "run" / "samples" / "eval"), input2=_Images(images), prc=True,
        feature_extractor=register_standin(), cuda=False, batch_size=4, verbose=False,
        cache=False, save_cpu_ram=True)
    assert ours["n_real"] == 9
    assert ours["precision_standin"] == library["precision"]
    assert ours["recall_standin"] == library["recall"]
    bad = {"key": ({"images": images}, "has no 'arr_0' array .it has images."),
           "float": ({"arr_0": images.astype(np.float32)}, "arr_0 is float32 9x16x16x3"),
           "chw": ({"arr_0": images.transpose(0, 3, 1, 2)}, "arr_0 is uint8 9x3x16x16"),
           "size": ({"arr_0": np.zeros((2, 32, 32, 3), np.uint8)},
                    "holds 32 x 32 images but the samples are 16 x 16 .data.image_size.")}
    for name, (arrays, message) in bad.items():
        np.savez(tmp_path / f"{name}.npz", **arrays)
        with pytest.raises(EvalError, match=f"eval.pr_reference '.*{name}.npz'.*{message}"):
            open_reference_batch(str(tmp_path / f"{name}.npz"), 16)
    missing = _cfg(data, f"eval.pr_reference={tmp_path}/absent.npz")
    problems = PrecisionRecall.problems(missing)
    assert len(problems) == 1 and "absent.npz' does not exist" in problems[0]


# --------------------------------------------------------------------------------------------
# Files and settings
# --------------------------------------------------------------------------------------------
def test_metrics_name_their_files_and_protocol(data, tmp_path, monkeypatch):
    from rebm.eval.evaluator import Evaluator
    from rebm.eval.registry import metric_classes

    def metric_settings(cfg, names):
        return Evaluator(cfg.evaluation, Runtime(), names).settings()

    monkeypatch.delenv(FEATURES_ENV, raising=False)
    weights = str(tmp_path / "w.pth")
    cfg = _cfg(data, f"image_log.inception_weights={weights}",
               f"image_log.seed_images={tmp_path}/seeds")
    classes = {m.name: m for m in metric_classes(("fid", "inception_score", "precision_recall",
                                                  "sample_grid"))}
    fid, is_, pr, grid = (classes[name] for name in ("fid", "inception_score",
                                                     "precision_recall", "sample_grid"))
    assert fid.files(cfg.evaluation) == {"image_log.data_dir": f"{data}/stats.npz",
                              "image_log.seed_images": f"{tmp_path}/seeds",
                              "image_log.inception_weights": weights}
    assert is_.files(cfg.evaluation) == {"image_log.seed_images": f"{tmp_path}/seeds",
                              "image_log.inception_weights": weights}
    assert pr.files(cfg.evaluation)["data.indist_ds_dir"] == str(data)
    ref = _cfg(data, "eval.pr_reference=/refs/VIRTUAL_imagenet256_labeled.npz")
    assert pr.files(ref.evaluation)["eval.pr_reference"] == "/refs/VIRTUAL_imagenet256_labeled.npz"
    assert "data.indist_ds_dir" not in pr.files(ref.evaluation)
    assert grid.files(_cfg(data)) == {}
    assert grid.files(_cfg(data, "image_log.seed_images=gaussian")) == {
        "data.indist_ds_dir": str(data)}
    monkeypatch.setenv(FEATURES_ENV, STANDIN)
    assert "image_log.inception_weights" not in fid.files(cfg.evaluation)
    assert all(m.protocol >= 2 for m in (fid, is_, pr, grid))
    settings = metric_settings(cfg, ("fid", "inception_score", "precision_recall"))
    assert settings["fid"]["pixels"] == "floor" and settings["fid"]["conditional"]
    assert settings["inception_score"]["is_resize"] == "pil"
    assert settings["precision_recall"]["reference"] == "class-balanced random subset"
    assert metric_settings(ref, ("precision_recall",))["precision_recall"]["reference"] == "npz"


def test_metrics_of_one_pass_keep_their_own_inception_weights(data, monkeypatch):
    """The table runner gives every metric of a shared sample pass its own config and one
    Evaluator: a metric naming other Inception weights gets its own network, never the one
    another metric built first, and each network is built once, at start."""
    from rebm.eval.evaluator import Evaluator
    from rebm.eval.features.fidelity import shared_extractor

    monkeypatch.setenv(FEATURES_ENV, STANDIN)
    configs = {"inception_score": _cfg(data, "image_log.inception_weights=a.pth"),
               "precision_recall": _cfg(data, "image_log.inception_weights=b.pth")}
    sections = {name: config.evaluation for name, config in configs.items()}
    evaluator = Evaluator(sections["inception_score"], Runtime(), list(sections),
                          sections=sections).start_all_ranks()
    built = dict(evaluator.resources)
    first = shared_extractor(sections["inception_score"], Runtime(), evaluator.resources)
    other = shared_extractor(sections["precision_recall"], Runtime(), evaluator.resources)
    assert other is not first
    assert first is next(value for key, value in built.items() if "a.pth" in key)
    assert evaluator.resources == built
