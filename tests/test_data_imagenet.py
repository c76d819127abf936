"""ImageNet (torchvision layout) and OpenImage-O: layout checks, keyed sampling on 1/2 ranks,
deterministic replacement of unreadable JPEGs, the ImageNet augmentations, the config fields.

Tiny data written by the tests in the real formats (rebm/standin/writers.py)."""

from __future__ import annotations

import logging
import os
import pickle
import shutil

import numpy as np
import pytest
import torch
import torchvision

from rebm.config import TrainConfig, plan_batches
from rebm.config.loading import ConfigError, load_config
from rebm.data.augmentations import IMAGENET_AUGMENTATIONS, augment_batch, build_augmentation
from rebm.data.imagenet import openimages_files
from rebm.data.pipeline import (
    DataError,
    build_eval_data,
    build_train_data,
    load_indist,
    load_outdist,
    outdist_augmentation,
)
from rebm.data.streams import CLASSIFIER, INDIST, OUTDIST
from rebm.distributed import Runtime
from rebm.standin.writers import (
    imagenet_wnids,
    truncate_file,
    write_fake_imagenet,
    write_fake_openimage_o,
    write_image_folder,
)

pytestmark = pytest.mark.numbers

STREAMS = (INDIST, CLASSIFIER, OUTDIST)  # DAT's three streams

CLASSES, N_TRAIN, N_VAL = 3, 4, 3  # 12 training images: 2 steps per epoch at batch 6


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("imagenet")
    imagenet = write_fake_imagenet(str(base / "ImageNet"), CLASSES, N_TRAIN, N_VAL)
    openimages = write_fake_openimage_o(str(base / "OpenImage-O"), n=9)
    return imagenet, openimages


@pytest.fixture(scope="module")
def corrupt_roots(roots, tmp_path_factory):
    """A copy of the tiny ImageNet with one truncated training JPEG (and one in val)."""
    base = tmp_path_factory.mktemp("corrupt")
    imagenet = shutil.copytree(roots[0], str(base / "ImageNet"))
    wnid = imagenet_wnids(CLASSES)[1]
    truncate_file(os.path.join(imagenet, "train", wnid, f"{wnid}_2.JPEG"))
    truncate_file(sorted(os.scandir(os.path.join(imagenet, "val", wnid)),
                         key=lambda e: e.name)[0].path)
    return imagenet, roots[1]


def make_cfg(roots, size: int = 32, **top) -> TrainConfig:
    cfg = TrainConfig()
    cfg.data.indist_dataset = "ImageNet"
    cfg.data.indist_ds_dir = roots[0]
    cfg.data.outdist_dataset = "OpenImageO"
    cfg.data.outdist_std_dir = roots[1]
    cfg.data.num_classes = CLASSES
    cfg.data.image_size = size
    cfg.data.num_workers = 0
    cfg.schedule.batch_size = 6
    cfg.data.augm_type_generation = "generation_id_randomcrop"
    cfg.data.augm_type_classification = "madry"
    for key, value in top.items():
        setattr(cfg.data, key, value)  # the data keys the tests vary
    return cfg


def rank_batches(cfg, step: int, rank: int, world_size: int):
    runtime = Runtime(rank=rank, world_size=world_size, local_world_size=world_size)
    return build_train_data(cfg.inputs, runtime, plan_batches(cfg.schedule, cfg.eval, world_size),
                            STREAMS).step_batch(step)


def global_batch(cfg, step: int, world_size: int):
    """{stream: sorted (index, label, image bytes)} over all ranks, and the replaced count."""
    union, replaced = {"in": [], "clf": [], "out": []}, 0
    for rank in range(world_size):
        for mb in rank_batches(cfg, step, rank, world_size):
            replaced += mb.replaced
            for name, x, y, idx in (("in", mb["in"].images, mb["in"].labels, mb["in"].indices),
                                    ("clf", mb["clf"].images, mb["clf"].labels, mb["clf"].indices),
                                    ("out", mb["out"].images, None, mb["out"].indices)):
                labels = [-1] * len(idx) if y is None else y.tolist()
                union[name] += [(int(i), lab, img.numpy().tobytes())
                                for i, lab, img in zip(idx, labels, x, strict=True)]
    return {k: sorted(v) for k, v in union.items()}, replaced


# --------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------
def test_fake_imagenet_is_torchvisions_layout(roots):
    tv_val = torchvision.datasets.ImageNet(roots[0], split="val")  # torchvision's own parser
    assert tv_val.wnids == imagenet_wnids(CLASSES) and len(tv_val) == CLASSES * N_VAL
    source = load_indist(make_cfg(roots).data, "test").source
    assert source.labels(np.arange(len(source))).tolist() == tv_val.targets
    assert [source.files[i] for i in range(len(source))] == [p for p, _ in tv_val.samples]
    x, y = load_indist(make_cfg(roots, 40).data, "test")[4]
    assert x.shape == (3, 40, 40) and x.dtype == torch.float32 and y == tv_val.targets[4]
    assert len(load_indist(make_cfg(roots).data, "train")) == CLASSES * N_TRAIN


def _layout_error(roots, tmp_path, break_it) -> str:
    root = shutil.copytree(roots[0], str(tmp_path / "copy"))
    break_it(root)
    cfg = make_cfg((root, roots[1]))
    with pytest.raises(DataError) as err:
        load_indist(cfg.data, "test")
    message = str(err.value)
    assert "\n" not in message
    return message


def test_bad_layouts_name_the_path_and_the_fix(roots, tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(DataError, match=f"ImageNet root {missing} does not exist.*indist_ds_dir"):
        load_indist(make_cfg((missing, roots[1])).data, "train")
    msg = _layout_error(roots, tmp_path / "a", lambda r: os.remove(os.path.join(r, "meta.bin")))
    assert "meta.bin is missing" in msg and "ILSVRC2012_devkit_t12.tar.gz" in msg
    msg = _layout_error(roots, tmp_path / "b", lambda r: shutil.rmtree(os.path.join(r, "val")))
    assert "split folder" in msg and os.path.join("copy", "val") in msg
    msg = _layout_error(roots, tmp_path / "c", lambda r: os.makedirs(
        os.path.join(r, "val", "n99999999")))
    assert "n99999999" in msg and "meta.bin" in msg
    extra = imagenet_wnids(CLASSES + 1)[-1]

    def add_class(root):
        shutil.copytree(os.path.join(root, "val", imagenet_wnids(CLASSES)[0]),
                        os.path.join(root, "val", extra))
        wnid_to_classes, val_wnids = torch.load(os.path.join(root, "meta.bin"))
        wnid_to_classes[extra] = ("extra",)
        torch.save((wnid_to_classes, val_wnids), os.path.join(root, "meta.bin"))

    msg = _layout_error(roots, tmp_path / "d", add_class)
    assert f"{CLASSES + 1} class folders but data.num_classes is {CLASSES}" in msg
    assert f"data.num_classes={CLASSES + 1}" in msg


class _Payload:
    def __reduce__(self):
        return (os.mkdir, (os.environ["REBM_TEST_MARKER"],))


def test_meta_bin_is_not_unpickled_into_objects(roots, tmp_path, monkeypatch):
    marker = str(tmp_path / "code_ran")
    monkeypatch.setenv("REBM_TEST_MARKER", marker)

    def hostile(root):
        with open(os.path.join(root, "meta.bin"), "wb") as f:
            pickle.dump((_Payload(), []), f, protocol=2)

    msg = _layout_error(roots, tmp_path / "h", hostile)
    assert "cannot read ImageNet" in msg and not os.path.exists(marker)


def test_openimage_o_folder_and_fixed_subset(roots, tmp_path):
    cfg = make_cfg(roots)
    assert len(load_outdist(cfg.inputs)) == 9
    subset = load_outdist(make_cfg(roots, openimages_max_samples=4).inputs).source
    every = openimages_files(roots[1])
    keep = torch.randperm(9, generator=torch.Generator().manual_seed(42))[:4].tolist()
    assert [subset.files[i] for i in range(4)] == [every[i] for i in keep]
    # class sub-folders: ImageFolder's order, so the subset is the original's
    folder = write_image_folder(str(tmp_path / "oo"), n_per_class=3, classes=["b", "a", "c"])
    assert openimages_files(folder) == [p for p, _ in torchvision.datasets.ImageFolder(
        folder).samples]
    with pytest.raises(DataError, match="OpenImage-O folder .* does not exist"):
        load_outdist(make_cfg((roots[0], str(tmp_path / "none"))).inputs)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(DataError, match="holds no images"):
        load_outdist(make_cfg((roots[0], str(tmp_path / "empty"))).inputs)


# --------------------------------------------------------------------------------------------
# Keyed sampling, workers, resume
# --------------------------------------------------------------------------------------------
def test_global_batch_identical_on_1_and_2_ranks(roots):
    cfg = make_cfg(roots)
    for step in (0, 3):
        reference, _ = global_batch(cfg, step, 1)
        assert all(len(v) == cfg.schedule.batch_size for v in reference.values())
        assert global_batch(cfg, step, 2)[0] == reference
        cfg.schedule.per_device_batch_size = 1  # 2 ranks x 3 accumulation micro-steps
        assert global_batch(cfg, step, 2)[0] == reference
        cfg.schedule.per_device_batch_size = None


def test_corrupt_jpeg_replaced_identically_and_counted(corrupt_roots, caplog):
    cfg = make_cfg(corrupt_roots)
    total = {1: 0, 2: 0}
    for step in (0, 1):  # one epoch of each in-distribution stream: every image once
        single, total_1 = global_batch(cfg, step, 1)
        double, total_2 = global_batch(cfg, step, 2)
        assert single == double
        total[1] += total_1
        total[2] += total_2
    assert total == {1: 2, 2: 2}  # met once by the EBM stream and once by the classifier's
    # the replacement is the next index (same class here), so its label comes with it
    data = build_train_data(cfg.inputs, Runtime(), plan_batches(cfg.schedule, cfg.eval, 1), STREAMS)
    with caplog.at_level(logging.WARNING):
        for step in range(4):  # two epochs: counted every time, logged once
            data.step_batch(step)
    assert data.replaced_images == 4
    lines = [r for r in caplog.records if "unreadable image" in r.getMessage()]
    assert len(lines) == 1 and "_2.JPEG" in lines[0].getMessage()


def test_workers_decode_and_resume_is_exact(corrupt_roots):
    cfg = make_cfg(corrupt_roots)
    cfg.data.num_workers = 2
    plan = plan_batches(cfg.schedule, cfg.eval, 1)
    resumed = build_train_data(cfg.inputs, Runtime(), plan, STREAMS, start_step=1)
    assert resumed._loader_kwargs["num_workers"] == min(2, len(os.sched_getaffinity(0)))
    direct = make_cfg(corrupt_roots)
    fresh = build_train_data(direct.inputs, Runtime(), plan, STREAMS)
    got = [group for _, group in zip(range(3), resumed, strict=False)]  # no 4th step read
    for step, group in zip((1, 2, 3), got, strict=True):
        want = fresh.step_batch(step)[0]
        assert torch.equal(group[0]["clf"].images, want["clf"].images) and torch.equal(group[0]["out"].images, want["out"].images)
        assert torch.equal(group[0]["in"].labels, want["in"].labels) and group[0].replaced == want.replaced
    assert resumed.replaced_images == sum(g[0].replaced for g in got) >= 1


def test_eval_over_val_is_identical_on_1_and_2_ranks(corrupt_roots):
    cfg = make_cfg(corrupt_roots)
    shards = {}
    for world_size in (1, 2):
        rows = []
        for rank in range(world_size):
            runtime = Runtime(rank=rank, world_size=world_size, local_world_size=world_size)
            for x, y, idx in build_eval_data(cfg.data, runtime, batch_size=4, split="test"):
                rows += [(int(i), int(t), img.numpy().tobytes())
                         for i, t, img in zip(idx, y, x, strict=True)]
        shards[world_size] = sorted(rows)
    assert shards[1] == shards[2] and [r[0] for r in shards[1]] == list(range(CLASSES * N_VAL))


# --------------------------------------------------------------------------------------------
# Augmentations and config
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [224, 256])
def test_imagenet_augmentations_shapes_ranges_seeds(size):
    image = torch.randint(0, 256, (1, 3, 375, 500), dtype=torch.uint8)  # ImageNet-like size
    for name in IMAGENET_AUGMENTATIONS + ("none", "test"):
        transform = build_augmentation(name, size, full_images=True)
        out = augment_batch(image, transform, [7])
        assert out.shape == (1, 3, size, size) and out.dtype == torch.float32, name
        margin = 0.05 if name == "madry" else 0.0  # its lighting is not clamped (below)
        assert -margin <= float(out.min()) and float(out.max()) <= 1.0 + margin, name
        assert torch.equal(out, augment_batch(image, transform, [7])), name
    changed = [not torch.equal(augment_batch(image, build_augmentation(n, size), [1]),
                               augment_batch(image, build_augmentation(n, size), [2]))
               for n in ("madry", "default", "generation_od_randomcrop")]
    assert all(changed)


def test_madry_lighting_is_the_originals_arithmetic_without_a_clamp():
    """The original's Lighting (InNOutRobustness/utils/datasets/augmentations/
    imagenet_augmentation.py:34-40) written out: alpha ~ normal_(0, 0.05) of 3, each eigenvector
    column times its alpha times its eigenvalue, summed per channel and added to every pixel, and
    nothing clamps the result. Bit for bit on an image of black and white pixels, which the
    shift takes out of [0, 1]."""
    from rebm.data.augmentations import IMAGENET_EIGVAL, IMAGENET_EIGVEC, Lighting

    image = torch.zeros(3, 17, 17)
    image[:, ::2] = 1.0
    eigval, eigvec = torch.tensor(IMAGENET_EIGVAL), torch.tensor(IMAGENET_EIGVEC)
    for seed in range(40):
        torch.manual_seed(seed)
        alpha = torch.Tensor().resize_(3).normal_(0, 0.05)
        shift = (eigvec.clone().mul(alpha.view(1, 3).expand(3, 3))
                 .mul(eigval.view(1, 3).expand(3, 3)).sum(1).squeeze())
        expected = image.add(shift.view(3, 1, 1).expand_as(image))
        torch.manual_seed(seed)
        assert torch.equal(Lighting(0.05)(image), expected), seed
        assert float(expected.min()) < 0.0 or float(expected.max()) > 1.0, seed


def test_outdist_augmentation_follows_the_original(roots):
    assert outdist_augmentation(make_cfg(roots).inputs) == "generation_od_randomcrop"
    cfg = make_cfg(roots, augm_type_generation="generation_id")
    assert outdist_augmentation(cfg.inputs) == "generation_od"
    cfg.data.openimages_augm = "default"
    assert outdist_augmentation(cfg.inputs) == "default"


def test_config_fields_of_the_original_imagenet_configs(tmp_path):
    path = tmp_path / "imagenet.yaml"
    path.write_text(
        "data:\n  indist_dataset: ImageNet\n  indist_ds_dir: data/ImageNet\n"
        "  outdist_dataset: OpenImageO\n  outdist_std_dir: data/OpenImage-O-large/train\n"
        "  num_workers: 16\n  num_classes: 1000\n"
        "augm_type_classification: default\naugm_type_generation: generation_id\n"
        "openimages_max_samples: 300000\nbatch_size: 512\n")
    cfg = load_config(str(path))
    assert cfg.data.image_size == 256 and cfg.data.openimages_max_samples == 300000
    assert load_config(str(path), ["data.image_size=224"]).data.image_size == 224
    assert load_config(str(path), ["openimages_augm=generation_od"]).data.openimages_augm
    with pytest.raises(ConfigError, match="openimages_augm: fancy' is not a valid choice"):
        load_config(str(path), ["openimages_augm=fancy"])
    with pytest.raises(ConfigError, match="openimages_max_samples"):
        load_config(str(path), ["openimages_max_samples=0"])



def test_metrics_hook_for_replaced_images(corrupt_roots):
    from rebm.engine.metrics_window import MetricsWindow, add_data_counts, pop_data_counts

    cfg = make_cfg(corrupt_roots)
    data = build_train_data(cfg.inputs, Runtime(), plan_batches(cfg.schedule, cfg.eval, 1), STREAMS)
    window = MetricsWindow()
    for step in (0, 1):  # one epoch: the truncated file is met twice (EBM + classifier stream)
        add_data_counts(window, data.step_batch(step))
        window.add({"n": 1.0})
    totals, _ = window.global_sums_all_ranks(Runtime())
    assert pop_data_counts(totals) == {"data_replaced_images": 2.0} and totals == {"n": 2.0}
    clean = MetricsWindow()
    add_data_counts(clean, [])
    assert clean.sums == {"data_replaced_images": 0.0}  # the key exists on every rank


def _count_rank(local_rank: int, world_size: int, port: int, roots, out_path: str) -> None:
    """One real gloo rank: one epoch of batches, the replaced count through the metrics window's
    all-reduce, and this rank's images."""
    from rebm.distributed import setup_distributed
    from rebm.engine.metrics_window import MetricsWindow, add_data_counts, pop_data_counts

    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    runtime = setup_distributed(backend="gloo", device="cpu")
    cfg = make_cfg(roots)
    data = build_train_data(cfg.inputs, runtime, plan_batches(cfg.schedule, cfg.eval, runtime.world_size), STREAMS)
    window, images = MetricsWindow(), []
    for step in (0, 1):
        batches = data.step_batch(step)
        add_data_counts(window, batches)
        window.add({"n": 1.0})
        images += [(int(i), x.numpy().tobytes()) for mb in batches
                   for i, x in zip(mb["clf"].indices, mb["clf"].images, strict=True)]
    counts = pop_data_counts(window.global_sums_all_ranks(runtime)[0])
    gathered = [None] * runtime.world_size
    torch.distributed.all_gather_object(gathered, images)
    if runtime.rank == 0:
        with open(out_path, "wb") as f:
            pickle.dump((counts, gathered), f)
    torch.distributed.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_real_ranks_count_and_read_like_one(corrupt_roots, tmp_path):
    import torch.multiprocessing as mp

    from rebm.distributed import free_port

    out_path = str(tmp_path / "counts.pkl")
    mp.start_processes(_count_rank, args=(2, free_port(), corrupt_roots, out_path), nprocs=2,
                       join=True, start_method="fork")
    with open(out_path, "rb") as f:
        counts, gathered = pickle.load(f)
    assert counts == {"data_replaced_images": 2.0}  # as one process counts (test above)
    single = [(int(i), x.numpy().tobytes()) for step in (0, 1)
              for mb in rank_batches(make_cfg(corrupt_roots), step, 0, 1)
              for i, x in zip(mb["clf"].indices, mb["clf"].images, strict=True)]
    assert sorted(gathered[0] + gathered[1]) == sorted(single)


def test_seeded_reads_leave_the_rng_alone_and_unseeded_reads_vary(roots):
    source = load_indist(make_cfg(roots).data, "train").source
    transform = build_augmentation("default", 32, full_images=True)
    state = torch.get_rng_state()
    source.read(np.arange(3), transform, [1, 2, 3])
    assert torch.equal(torch.get_rng_state(), state)
    first = source.read(np.zeros(4, dtype=np.int64), transform, None).images
    assert not all(torch.equal(first[0], img) for img in first[1:])  # fresh draws per image
