"""OOD detection (rebm/eval/metrics/ood_sets.py, rebm/data/ood_datasets.py): the metrics against scikit-learn,
the original's attacks and their budget by the OOD image side, the OOD sets read from real
on-disk formats (SVHN .mat files written with scipy in torchvision's layout, CIFAR pickles,
image folders, a 1000-class ImageNet validation folder for restricted_imagenet), the original's
noise bit for bit, and the table's numbers identical on 1 and 2 real processes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from rebm import distributed as rd
from rebm.auc import binary_auc
from rebm.config import load_config
from rebm.data.ood_datasets import RESTRICTED_IMAGENET_RANGES, DataError, load_ood_set, load_svhn
from rebm.eval.metrics.ood_detection import OODDetection
from rebm.eval.metrics.ood_sets import (
    OODSets,
    fpr_at_tpr,
    ood_image_size,
    ood_score,
    original_ood_attack,
)
from rebm.standin.writers import (
    imagenet_wnids,
    write_fake_cifar10,
    write_fake_cifar100,
    write_fake_svhn,
    write_image_folder,
)
from tests.processes import spawn_ranks

# one torch thread in this process: the pytest workers already fill the cores
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.numbers]


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_pos, n_neg, levels", [(20, 7, 5), (101, 37, 3), (57, 200, 1000),
                                                   (3, 4, 2), (1000, 1000, 17)])
def test_fpr_at_95_tpr_equals_scikit_learn_with_ties(n_pos, n_neg, levels):
    from sklearn.metrics import roc_curve

    rng = np.random.default_rng(n_pos * 7 + levels)
    pos = rng.integers(0, levels, n_pos) / levels + 0.2  # few levels: many ties
    neg = rng.integers(0, levels, n_neg) / levels
    labels = np.r_[np.ones(n_pos), np.zeros(n_neg)]
    fpr, tpr, _ = roc_curve(labels, np.r_[pos, neg], drop_intermediate=False)
    expected = fpr[np.argmax(tpr >= 0.95)]
    assert fpr_at_tpr(torch.from_numpy(pos), torch.from_numpy(neg)) == pytest.approx(
        expected, abs=1e-15)


def test_fpr_hand_example():
    pos = torch.tensor([5.0, 4.0, 3.0, 3.0, 1.0])  # k = ceil(0.95 * 5) = 5: threshold 1.0
    neg = torch.tensor([0.5, 1.0, 2.0, 6.0])  # 1.0, 2.0 and 6.0 reach it (a tie counts)
    assert fpr_at_tpr(pos, neg) == 0.75
    assert fpr_at_tpr(pos, neg, tpr_percent=60) == 0.25  # k = 3: threshold 3.0


def test_scores_and_the_original_attack_budgets():
    logits = torch.tensor([[0.0, 0.0], [3.0, 1.0]])
    assert ood_score(logits, "msp").tolist() == pytest.approx([0.5, 1 / (1 + np.exp(-2.0))])
    assert ood_score(logits, "max_softmax").tolist() == ood_score(logits, "msp").tolist()
    assert ood_score(logits, "lse")[0].item() == pytest.approx(np.log(2.0))
    small, large = original_ood_attack(32), original_ood_attack(224)
    assert (small.eps, small.steps, small.step_size) == (1.0, 20, 0.1)
    assert (large.eps, large.steps, large.step_size) == (3.0, 10, 1.0)
    assert original_ood_attack(256) == large


def test_scores_are_the_originals_float32_arithmetic():
    """The original scores in float32 (its rebm/eval/eval_utils.py:1165, 1207, 1269): the same
    bits here, and a near-tie pair that float64 would order stays the tie it is in float32."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(4)
    logits = 3 * torch.randn(64, 10, generator=g)
    assert torch.equal(ood_score(logits, "msp"),
                       torch.max(F.softmax(logits, dim=1), dim=1)[0].double())
    assert torch.equal(ood_score(logits, "lse"), torch.logsumexp(logits, dim=1).double())
    assert torch.equal(ood_score(logits.double(), "msp"), ood_score(logits, "msp"))
    # two images whose max-softmax differ by about 1e-12: equal in float32, ordered in float64
    near_tie = torch.tensor([[2.0, 0.0], [2.0 + 1e-11, 0.0]], dtype=torch.float64)
    float64_scores = near_tie.softmax(dim=1).max(dim=1).values
    assert float64_scores[1] > float64_scores[0]
    scores = ood_score(near_tie, "msp")
    assert scores[0] == scores[1]
    assert binary_auc(scores[1:], scores[:1]) == 0.5  # a tie, as the original's roc_curve sees it


def test_uniform_kl_attack_raises_the_max_softmax_within_the_ball():
    from rebm.attacks.pgd import pgd_attack
    from rebm.models import build_model

    torch.manual_seed(0)
    model = build_model("WideResNet10x1", 10).eval()
    x = torch.rand(6, 3, 16, 16)
    x_adv = pgd_attack(model, x, steps=10, step_size=0.1, eps=1.0, norm="L2",
                       objective="uniform_kl")
    with torch.no_grad():
        before, after = ood_score(model(x), "msp"), ood_score(model(x_adv), "msp")
    assert (after > before).all()
    assert (x_adv - x).flatten(1).norm(dim=1).max() <= 1.0 + 1e-5


# --------------------------------------------------------------------------------------------
# OOD sets from files
# --------------------------------------------------------------------------------------------
def test_svhn_read_through_torchvision_from_mat_files(tmp_path):
    from scipy.io import loadmat

    path = write_fake_svhn(str(tmp_path), 9)
    source = load_svhn(str(tmp_path), "train", 32)
    raw = loadmat(path)
    assert len(source) == 9
    np.testing.assert_array_equal(source.images(np.array([4]))[0].permute(1, 2, 0).numpy(),
                                  raw["X"][..., 4])
    assert source.labels(np.arange(9)).tolist() == [v % 10 for v in raw["y"][:, 0].tolist()]
    assert load_svhn(str(tmp_path), "train", 16).images(np.array([0])).shape == (1, 3, 16, 16)


def test_ood_set_errors_are_one_line_naming_the_key(tmp_path):
    with pytest.raises(DataError, match=r"eval.ood_roots.svhn.*train_32x32.mat"):
        load_ood_set("svhn", 32, 0, 10, {"svhn": str(tmp_path)})
    with pytest.raises(DataError, match="unknown OOD set 'places'.*noise, svhn"):
        load_ood_set("places", 32, 0, 10)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "train_32x32.mat").write_bytes(b"not a mat file")
    with pytest.raises(DataError, match="cannot read SVHN") as err:
        load_ood_set("svhn", 32, 0, 10, {"svhn": str(tmp_path / "bad")})
    assert "\n" not in str(err.value)


def test_ood_subset_is_a_fixed_keyed_choice(tmp_path):
    write_fake_cifar100(str(tmp_path), n_train=60, n_test=5)
    first = load_ood_set("cifar100", 32, 3, 20, {"cifar100": str(tmp_path)})
    again = load_ood_set("cifar100", 32, 3, 20, {"cifar100": str(tmp_path)})
    other_seed = load_ood_set("cifar100", 32, 4, 20, {"cifar100": str(tmp_path)})
    assert len(first) == 20 and len(set(first.indices.tolist())) == 20
    assert first.indices.tolist() == again.indices.tolist()
    assert first.indices.tolist() != other_seed.indices.tolist()
    whole = load_ood_set("cifar100", 32, 3, 1000, {"cifar100": str(tmp_path)})
    assert sorted(whole.indices.tolist()) == list(range(60))
    noise = load_ood_set("noise", 16, 3, 7)
    assert noise.images(np.arange(7)).shape == (7, 3, 16, 16)


def test_32px_sets_at_224_px_are_the_originals_pil_bilinear_resize(tmp_path):
    """An ImageNet model reads CIFAR and SVHN at 224 px as the original did: each 32 px image
    through PIL's bilinear Resize(224) and ToTensor (its cifar/svhn 'none' augmentation), byte
    for byte; resized per batch, never as a whole set."""
    import pickle

    from PIL import Image
    from scipy.io import loadmat
    from torchvision import transforms

    from rebm.data.ood_datasets import ResizedSource
    from rebm.data.sources import TensorSource

    original = transforms.Compose([
        transforms.Resize(224, interpolation=transforms.InterpolationMode.BILINEAR),
        transforms.ToTensor()])
    write_fake_cifar100(str(tmp_path / "c100"), n_train=30, n_test=2)
    with open(tmp_path / "c100" / "cifar-100-python" / "train", "rb") as fh:
        raw = pickle.load(fh, encoding="latin1")["data"].reshape(-1, 3, 32, 32)
    write_fake_svhn(str(tmp_path / "svhn"), 30)
    svhn_raw = loadmat(tmp_path / "svhn" / "train_32x32.mat")["X"].transpose(3, 2, 0, 1)
    for name, pixels in (("cifar100", raw), ("svhn", svhn_raw)):
        subset = load_ood_set(name, 224, 5, 4, {name: str(tmp_path / name.replace(
            "cifar100", "c100"))})
        assert isinstance(subset.source, ResizedSource)  # not 30 x 3 x 224 x 224 in memory
        expected = torch.stack([original(Image.fromarray(pixels[i].transpose(1, 2, 0)))
                                for i in subset.indices])
        assert torch.equal(subset.images(np.arange(4)), expected), name
    # Noise: torchvision's uint8 resize matches PIL only through its AVX2 kernel; without it
    # (make test-dispatch, Arm) 13 % of these bytes differ by 1
    noise = np.random.default_rng(0).integers(0, 256, (4, 3, 32, 32), dtype=np.uint8)
    resized = ResizedSource(TensorSource(torch.from_numpy(noise), None, "noise"), 224)
    assert torch.equal(resized.images(np.arange(4)), torch.stack([
        transforms.PILToTensor()(transforms.Resize(224)(Image.fromarray(image.transpose(1, 2, 0))))
        for image in noise]))


# --------------------------------------------------------------------------------------------
# The OOD table on 1 and 2 processes
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ood_data(tmp_path_factory):
    from rebm.models import build_model

    root = tmp_path_factory.mktemp("ood")
    write_fake_cifar10(str(root / "cifar10"), n_train=10, n_test=23)
    write_fake_cifar100(str(root / "cifar100"), n_train=40, n_test=5)
    write_fake_svhn(str(root / "svhn"), 30)
    write_image_folder(str(root / "folder"), n_per_class=4)
    torch.manual_seed(0)
    torch.save(build_model("WideResNet10x1", 10).state_dict(), root / "model.pth")
    return root


def _ood_worker(root: str, out: str) -> None:
    from rebm.eval.evaluator import Evaluator, load_eval_model

    runtime = rd.setup_distributed()
    results = {}
    for score in ("msp", "lse"):
        cfg = load_config(None, [
            "data.indist_dataset=cifar10", f"data.indist_ds_dir={root}/cifar10",
            "data.image_size=16", "data.num_workers=0", "model.model_type=WideResNet10x1",
            f"model.ckpt_path={root}/model.pth", "rand_seed=2",
            f"eval.ood_datasets=[noise,svhn,cifar100,{root}/folder]", "eval.ood_num_samples=13",
            f"eval.ood_score={score}", "eval.ood_attack_steps=3", "eval.ood_attack_step_size=0.3",
            f"eval.ood_roots.svhn={root}/svhn", f"eval.ood_roots.cifar100={root}/cifar100"])
        model = load_eval_model(cfg.model, cfg.data, cfg.ema.use_ema, runtime)
        evaluator = Evaluator(cfg.evaluation, runtime, ("ood_sets",), batch_size=5)
        results[score] = evaluator.evaluate_all_ranks(model).values
    torch.save(results, os.path.join(out, f"w{runtime.world_size}_r{runtime.rank}.pt"))
    rd.teardown(runtime)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ood_table_identical_on_1_and_2_processes(ood_data, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the same float summation order everywhere
    for world in (1, 2):
        spawn_ranks(_ood_worker, world, str(ood_data), str(tmp_path))
    single = torch.load(tmp_path / "w1_r0.pt")
    for rank in (0, 1):
        assert torch.load(tmp_path / f"w2_r{rank}.pt") == single  # bit for bit
    for score, metrics in single.items():
        for name in ("noise", "svhn", "cifar100", "folder", "mean"):
            for key in ("auroc", "fpr95", "adv_auroc", "adv_fpr95"):
                assert 0.0 <= metrics[f"ood/{name}/{key}"] <= 1.0, (score, name, key)
        # the attack raised the OOD scores: detection got no easier
        assert metrics["ood/noise/adv_auroc"] <= metrics["ood/noise/auroc"], score
    assert single["msp"]["n_test"] == 23
    assert single["msp"]["ood/svhn/auroc"] != single["lse"]["ood/svhn/auroc"]


def test_settings_resolve_the_original_attack_and_problems_name_missing_roots(tmp_path):
    cfg = load_config(None, ["data.image_size=224", "data.indist_dataset=ImageNet",
                             "data.num_classes=1000", "eval.ood_datasets=[noise,svhn]",
                             f"eval.ood_roots.svhn={tmp_path}/absent", "eval.ood_attack_steps=4"])
    settings = OODSets.settings(cfg.evaluation)
    assert settings["attack"]["eps"] == 3.0 and settings["attack"]["step_size"] == 1.0
    assert settings["attack"]["steps"] == 4 and settings["attack"]["objective"] == "uniform_kl"
    assert settings["roots"] == {"svhn": f"{tmp_path}/absent"}
    assert OODSets.problems(cfg.evaluation) == [
        f"OOD set 'svhn': eval.ood_roots.svhn '{tmp_path}/absent' does not exist"]


IMAGENET = ["data.indist_dataset=ImageNet", "data.num_classes=1000"]


@pytest.mark.parametrize("model_size, overrides, side, budget", [
    (32, [], 32, (1.0, 20, 0.1)),  # CIFAR models: 32 px sets, the 32 px budget
    (224, IMAGENET, 224, (3.0, 10, 1.0)),
    (256, IMAGENET, 224, (3.0, 10, 1.0)),  # never the 32 px budget: its sets are read at 224
    (256, [*IMAGENET, "eval.ood_image_size=256"], 256, (3.0, 10, 1.0)),  # rebm's option
    (16, [], 16, (1.0, 20, 0.1)),  # a non-ImageNet model of another side: its own side
    (64, IMAGENET, 224, (3.0, 10, 1.0)),  # every ImageNet model: 224 px, whatever its own side
])
def test_ood_sets_are_read_by_model_kind_and_budgets_by_their_side(
        model_size, overrides, side, budget):
    """As the original (eval_ood_detection.py:53-61, eval_utils.ood_detection): OOD images at
    224 px for ImageNet models of any size, at 32 px for CIFAR models; the 3.0 budget for 224
    px images, the 1.0 one otherwise. Any other non-ImageNet model at its own side (the
    original had none). Metric "ood" reads its out-distribution at that side."""
    cfg = load_config(None, [f"data.image_size={model_size}", *overrides])
    assert ood_image_size(cfg.evaluation) == side
    assert OODDetection.settings(cfg.evaluation)["image_size"] == side
    attack = OODSets.settings(cfg.evaluation)["attack"]
    assert (attack["eps"], attack["steps"], attack["step_size"]) == budget
    assert OODSets.settings(cfg.evaluation)["image_size"] == side


@pytest.mark.parametrize("model_size, overrides, side",
                         [(256, IMAGENET, 224), (16, [], 16), (32, [], 32)])
def test_metric_ood_reads_its_noise_at_the_ood_side(model_size, overrides, side):
    """ImageNet models read their OOD noise at 224 px as the original's
    (eval_ood_detection.py:53-61), not at the model's data.image_size (256 px in the ImageNet
    recipes); other models at their own side (32 px for CIFAR as the original's, 16 px for
    digits)."""
    from rebm.distributed import Runtime
    from rebm.eval.metrics.ood_sets import build_ood_data

    cfg = load_config(None, [f"data.image_size={model_size}", "data.outdist_dataset=noise",
                             *overrides])
    images = next(iter(build_ood_data(cfg.evaluation, Runtime(), batch_size=3, num_samples=3)))[0]
    assert images.shape == (3, 3, side, side)


ENTRY_CASES = {  # model kind: (overrides, the sides that reach the model)
    # the quickstart's 16 px digits: test and OOD images alike at 16 px (the original's rule,
    # 32 px for every non-ImageNet model, would give it 32 px noise to tell apart)
    "digits": ([], [[16, 16]]),
    "cifar10": (["data.indist_dataset=cifar10", "data.image_size=32", "data.num_classes=10",
                 "data.outdist_dataset=noise"], [[32, 32]]),
    # ImageNet: OOD images at 224 px whatever the model's own side (64 px here)
    "imagenet": (["data.indist_dataset=ImageNet", "data.image_size=64", "data.num_classes=3",
                  "data.outdist_dataset=noise"], [[64, 64], [224, 224]]),
}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", list(ENTRY_CASES))
def test_evaluate_feeds_the_model_ood_images_at_the_ood_side(kind, tmp_path):
    """`python -m rebm.eval.evaluate --ood --metrics ood_sets` on the quickstart config: the
    sides of the images that reach the model (a forward pre-hook in
    tests/evaluate_recording_input_sides.py), the test images and the OOD images of `ood` and
    `ood_sets`, clean and attacked; and the side eval.json reports."""
    import json
    import sys

    from rebm.models import build_model, dataset_stats
    from rebm.standin.writers import write_fake_imagenet
    from tests.helpers import CONFIG, REPO, base_env, run_command

    overrides, sides = ENTRY_CASES[kind]
    data = []
    if kind == "cifar10":
        write_fake_cifar10(str(tmp_path / "cifar10"), n_train=10, n_test=17)
        data = [f"data.indist_ds_dir={tmp_path / 'cifar10'}"]
    elif kind == "imagenet":
        data = [f"data.indist_ds_dir={write_fake_imagenet(str(tmp_path / 'ImageNet'), n_val=3)}"]
    num_classes = 3 if kind == "imagenet" else 10
    torch.manual_seed(0)
    mean, std = dataset_stats("digits" if kind == "digits" else kind)
    ckpt = tmp_path / "model.pth"
    torch.save(build_model("WideResNet10x1", num_classes, mean=mean, std=std).state_dict(), ckpt)
    cmd = [sys.executable, "-m", "tests.evaluate_recording_input_sides", str(tmp_path / "sides"),
           str(REPO / CONFIG), *overrides, *data, f"model.ckpt_path={ckpt}", "eval.num_images=17",
           "indist_attack_clf.max_steps=1", "robust_eval_steps=1", "eval.ood_num_samples=13",
           "eval.ood_attack_steps=1", "--no-ece", "--ood", "--metrics", "ood_sets"]
    result = run_command(cmd, timeout=300, env=base_env()).assert_ok()
    assert json.loads((tmp_path / "sides").read_text()) == sides, result.output[-3000:]
    settings = json.loads((tmp_path / "eval.json").read_text())["settings"]
    assert settings["ood_sets"]["image_size"] == settings["ood"]["image_size"] == sides[-1][0]


def test_files_are_the_set_roots(tmp_path):
    cfg = load_config(None, [f"eval.ood_datasets=[noise,svhn,restricted_imagenet,{tmp_path}/f]",
                             f"eval.ood_roots.svhn={tmp_path}/svhn"])
    assert OODSets.files(cfg.evaluation) == {"eval.ood_roots.svhn": f"{tmp_path}/svhn",
                                  "eval.ood_roots.restricted_imagenet": "data/ImageNet",
                                  "eval.ood_datasets[f]": f"{tmp_path}/f"}
    outdist = load_config(None, ["data.outdist_dataset=tinyimages",
                                 f"data.outdist_std_dir={tmp_path}/tiny.bin"])
    assert OODDetection.files(outdist) == {"data.outdist_std_dir": f"{tmp_path}/tiny.bin"}
    assert OODDetection.files(load_config(None, ["data.outdist_dataset=noise"])) == {}


def test_noise_is_the_originals_bit_for_bit():
    """The original's NoiseDataset: numpy seeded with 123, rand(length, 3, S, S) as float32,
    each image through ToPILImage and ToTensor (torchvision's own transforms here)."""
    from torchvision import transforms

    n, size = 6, 12
    drawn = np.random.RandomState(123).rand(n, 3, size, size).astype(np.float32)
    to_pil, to_tensor = transforms.ToPILImage(), transforms.ToTensor()
    expected = torch.stack([to_tensor(to_pil(torch.from_numpy(drawn[i]))) for i in range(n)])
    noise = load_ood_set("noise", size, 7, n)  # any rand_seed: the original's noise is fixed
    assert noise.indices.tolist() == list(range(n))
    assert torch.equal(noise.images(np.arange(n)), expected)
    assert torch.equal(load_ood_set("noise", size, 0, 2).images(np.arange(2)), expected[:2])


def _write_val_only_imagenet(root, height: int = 6, width: int = 9) -> None:
    """ImageNet's validation split in torchvision's layout (meta.bin, val/<wnid>/*.JPEG), one
    small JPEG in each of the 1000 class folders (wnids in sorted order = class index)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    wnids = imagenet_wnids(1000)
    torch.save(({w: (f"class {i}",) for i, w in enumerate(wnids)}, wnids), root / "meta.bin")
    for i, wnid in enumerate(wnids):
        (root / "val" / wnid).mkdir(parents=True)
        pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "val" / wnid / f"ILSVRC2012_val_{i + 1:08d}.JPEG")


def test_restricted_imagenet_is_the_validation_split_outside_the_restricted_classes(tmp_path):
    from PIL import Image
    from torchvision import transforms

    _write_val_only_imagenet(tmp_path)
    roots = {"restricted_imagenet": str(tmp_path)}
    everything = load_ood_set("restricted_imagenet", 16, 0, 5000, roots)
    labels = everything.labels(np.arange(len(everything))).numpy()
    inside = {c for first, last in RESTRICTED_IMAGENET_RANGES for c in range(first, last + 1)}
    assert len(inside) == 203 and len(everything) == 1000 - 203
    assert sorted(labels.tolist()) == sorted(set(range(1000)) - inside)
    subset = load_ood_set("restricted_imagenet", 16, 0, 40, roots)
    assert len(subset) == 40 and not inside & set(subset.labels(np.arange(40)).tolist())
    # read as the original did: Resize((S, S), bicubic) of the file, then ToTensor
    original = transforms.Compose([
        transforms.Resize((16, 16), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.ToTensor()])
    label = int(subset.labels(np.array([0]))[0])
    wnid = imagenet_wnids(1000)[label]
    path = tmp_path / "val" / wnid / f"ILSVRC2012_val_{label + 1:08d}.JPEG"
    with Image.open(path) as image:
        expected = original(image.convert("RGB"))
    assert torch.equal(subset.images(np.array([0]))[0], expected)
