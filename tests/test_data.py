"""Data pipeline (issue 3): sharding, shuffles, per-sample augmentation, resume, errors.

All on tiny data written in the real on-disk formats (rebm/standin/writers.py)."""

from __future__ import annotations

import hashlib
import os
import pickle
import time

import numpy as np
import pytest
import torch

from rebm.config import TrainConfig, plan_batches
from rebm.data.augmentations import augment_batch, build_augmentation
from rebm.data.files import _UncheckedCIFAR10
from rebm.data.indexing import KeyedPermutation, rank_positions
from rebm.data.pipeline import (
    DataError,
    build_eval_data,
    build_train_data,
    image_tensor_file,
    load_indist,
    load_outdist,
    loader_workers,
)
from rebm.data.sources import TinyImagesSource
from rebm.data.streams import CLASSIFIER, INDIST, OUTDIST
from rebm.distributed import Runtime
from rebm.standin.writers import (
    write_fake_cifar10,
    write_fake_cifar100,
    write_image_folder,
    write_tensor_file,
    write_tiny_images,
)
from tests.helpers import make_cfg

pytestmark = pytest.mark.numbers

N_TRAIN = 120  # 120 / 24 = 5 steps per epoch
STREAMS = (INDIST, CLASSIFIER, OUTDIST)  # DAT's three streams


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cifar"))
    write_fake_cifar10(root, n_train=N_TRAIN, n_test=101)
    return root


def image_hash(x: torch.Tensor) -> str:
    return hashlib.sha1(x.contiguous().numpy().tobytes()).hexdigest()[:16]


def step_pairs(cfg: TrainConfig, step: int, rank: int = 0, world_size: int = 1,
               per_device=None) -> dict:
    """{stream: sorted (index, image hash) pairs} of this rank at `step`."""
    cfg.schedule.per_device_batch_size = per_device
    plan = plan_batches(cfg.schedule, cfg.eval, world_size)
    runtime = Runtime(rank=rank, world_size=world_size, local_world_size=world_size)
    micro_batches = build_train_data(cfg.inputs, runtime, plan, STREAMS).step_batch(step)
    assert len(micro_batches) == plan.accumulation_steps
    pairs = {"in": [], "clf": [], "out": []}
    for mb in micro_batches:
        assert mb["in"].images.shape[0] == plan.per_device_batch_size
        for name, x, idx in (("in", mb["in"].images, mb["in"].indices), ("clf", mb["clf"].images, mb["clf"].indices),
                             ("out", mb["out"].images, mb["out"].indices)):
            pairs[name] += [(int(i), image_hash(img)) for i, img in zip(idx, x, strict=True)]
    return pairs


def union_over_ranks(cfg, step, world_size, per_device=None) -> dict:
    union = {"in": [], "clf": [], "out": []}
    for rank in range(world_size):
        for name, pairs in step_pairs(cfg, step, rank, world_size, per_device).items():
            union[name] += pairs
    return {name: sorted(pairs) for name, pairs in union.items()}


# --------------------------------------------------------------------------------------------
# Real on-disk format
# --------------------------------------------------------------------------------------------
def test_fake_cifar_is_read_by_torchvision_code(cifar_root, tmp_path):
    ds = _UncheckedCIFAR10(cifar_root, train=True, download=False)  # torchvision's own loader
    assert ds.data.shape == (N_TRAIN, 32, 32, 3) and len(ds.targets) == N_TRAIN
    source = load_indist(make_cfg(cifar_root).data, "train").source
    assert torch.equal(source.data, torch.from_numpy(ds.data).permute(0, 3, 1, 2))
    assert source.labels(np.arange(N_TRAIN)).tolist() == ds.targets

    write_fake_cifar100(str(tmp_path), n_train=30, n_test=10)
    cfg = make_cfg(str(tmp_path), indist_dataset="cifar100-conditional", num_classes=100)
    x, y = load_indist(cfg.data, "test")[3]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and 0 <= y < 100
    with pytest.raises(DataError, match="data.num_classes"):
        load_indist(make_cfg(str(tmp_path), indist_dataset="cifar100").data, "test")


# --------------------------------------------------------------------------------------------
# Sharding: the union over ranks is the global batch
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("per_device_factor", [1, 2])  # 2 = two accumulation micro-steps
def test_rank_positions_partition_the_block(world_size, per_device_factor):
    global_batch = 12
    per_device = global_batch // world_size // per_device_factor
    block_start = 5 * global_batch
    got = np.concatenate([
        rank_positions(block_start, r, world_size, m, per_device)
        for r in range(world_size) for m in range(per_device_factor)
    ])
    assert sorted(got.tolist()) == list(range(block_start, block_start + global_batch))


def test_permutation_is_a_bijection():
    for n in (1, 2, 7, 100, 4097):
        perm = KeyedPermutation(n, seed=3, stream="in", epoch=1)
        assert sorted(perm(np.arange(n)).tolist()) == list(range(n))
    big = KeyedPermutation(80_000_000, seed=0, stream="out", epoch=0)
    values = big(np.arange(10_000))
    assert values.min() >= 0 and values.max() < 80_000_000 and len(set(values.tolist())) == 10_000


def test_global_batch_is_identical_on_1_2_3_ranks(cifar_root):
    cfg = make_cfg(cifar_root)
    step = 7  # epoch 1 of the in-dist streams
    reference = union_over_ranks(cfg, step, 1)
    assert all(len(pairs) == cfg.schedule.batch_size for pairs in reference.values())
    for world_size in (2, 3):
        assert union_over_ranks(cfg, step, world_size) == reference
    # gradient accumulation: 2 ranks x 3 micro-steps of 4
    assert union_over_ranks(cfg, step, 2, per_device=4) == reference


def test_worker_count_does_not_change_batches(cifar_root):
    cfg = make_cfg(cifar_root, num_workers=2)
    plan = plan_batches(cfg.schedule, cfg.eval, 1)
    with_workers = build_train_data(cfg.inputs, Runtime(), plan, STREAMS, start_step=3)
    assert with_workers._loader_kwargs["num_workers"] == min(2, len(os.sched_getaffinity(0)))
    in_process = build_train_data(make_cfg(cifar_root).inputs, Runtime(), plan, STREAMS,
                                  start_step=3)
    for a, b in zip(iter(with_workers), [in_process.step_batch(s) for s in (3, 4, 5)], strict=False):
        assert torch.equal(a[0]["clf"].images, b[0]["clf"].images) and torch.equal(a[0]["out"].indices, b[0]["out"].indices)


def _rank_main(local_rank: int, world_size: int, port: int, root: str, out_path: str,
               step: int) -> None:
    """One real rank: the environment torchrun would set, then the normal setup path."""
    import torch.distributed as dist

    from rebm.distributed import setup_distributed

    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    runtime = setup_distributed(backend="gloo", device="cpu")
    cfg = make_cfg(root)
    mb, = build_train_data(cfg.inputs, runtime, plan_batches(cfg.schedule, cfg.eval, runtime.world_size),
                           STREAMS).step_batch(step)
    mine = [(int(i), image_hash(x)) for i, x in zip(mb["clf"].indices, mb["clf"].images, strict=True)]
    mine += [(int(i), image_hash(x)) for i, x in zip(mb["in"].indices, mb["in"].images, strict=True)]
    gathered = [None] * runtime.world_size
    dist.all_gather_object(gathered, mine)
    if runtime.rank == 0:
        with open(out_path, "wb") as f:
            pickle.dump(gathered, f)
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_real_processes_match_single_process(cifar_root, tmp_path):
    import torch.multiprocessing as mp

    from rebm.distributed import free_port

    out_path = str(tmp_path / "gathered.pkl")
    step = 6
    # fork (not spawn): the two gloo ranks are real processes, but need not re-import torch
    # (several seconds each on a small CI machine)
    mp.start_processes(_rank_main, args=(2, free_port(), cifar_root, out_path, step), nprocs=2,
                       join=True, start_method="fork")
    with open(out_path, "rb") as f:
        per_rank = pickle.load(f)
    assert len(per_rank) == 2 and set(per_rank[0]).isdisjoint(per_rank[1])
    single = step_pairs(make_cfg(cifar_root), step)
    assert sorted(per_rank[0] + per_rank[1]) == sorted(single["clf"] + single["in"])


# --------------------------------------------------------------------------------------------
# Evaluation shards
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_test", [13, 101])
def test_eval_shards_partition_the_test_set(tmp_path, n_test):
    write_fake_cifar10(str(tmp_path), n_train=10, n_test=n_test)
    cfg = make_cfg(str(tmp_path))
    single = {}
    for x, y, index in build_eval_data(cfg.data, Runtime(), batch_size=8):
        single.update({int(i): (image_hash(xi), int(yi)) for xi, yi, i in zip(x, y, index, strict=True)})
    assert sorted(single) == list(range(n_test))
    for world_size in (2, 3):
        seen = {}
        for rank in range(world_size):
            runtime = Runtime(rank=rank, world_size=world_size, local_world_size=world_size)
            for x, y, index in build_eval_data(cfg.data, runtime, batch_size=8):
                for xi, yi, i in zip(x, y, index, strict=True):
                    assert int(i) not in seen, "an index on two ranks (padding duplicate)"
                    seen[int(i)] = (image_hash(xi), int(yi))
        assert seen == single


# --------------------------------------------------------------------------------------------
# Shuffles
# --------------------------------------------------------------------------------------------
def _orders(cfg, steps) -> list:
    """Per step: {stream: dataset indices} of the single-process global batch."""
    data = build_train_data(cfg.inputs, Runtime(), plan_batches(cfg.schedule, cfg.eval, 1), STREAMS)
    orders = []
    for step in steps:
        mb, = data.step_batch(step)
        orders.append({"in": mb["in"].indices.tolist(), "clf": mb["clf"].indices.tolist(),
                       "out": mb["out"].indices.tolist()})
    return orders


def test_shuffles_differ_by_epoch_seed_and_stream(cifar_root):
    cfg = make_cfg(cifar_root)
    data = build_train_data(cfg.inputs, Runtime(), plan_batches(cfg.schedule, cfg.eval, 1), STREAMS)
    assert data.steps_per_epoch == N_TRAIN // cfg.schedule.batch_size == 5
    assert data.epoch_of(4) == 0 and data.epoch_of(5) == 1
    orders = _orders(cfg, range(10))
    epoch0 = [o["in"] for o in orders[:5]]
    epoch1 = [o["in"] for o in orders[5:]]
    assert sorted(sum(epoch0, [])) == sorted(sum(epoch1, [])) == list(range(120))
    assert epoch0 != epoch1
    first = orders[0]
    assert first["in"] != first["clf"] and first["in"] != first["out"]
    cfg.schedule.rand_seed = 1
    assert _orders(cfg, [0])[0]["in"] != first["in"]


def test_same_index_gets_new_augmentation_each_epoch(cifar_root):
    cfg = make_cfg(cifar_root)
    data = build_train_data(cfg.inputs, Runtime(), plan_batches(cfg.schedule, cfg.eval, 1), STREAMS)
    images = {}
    for step in range(10):  # two epochs: every index once per epoch
        mb, = data.step_batch(step)
        for i, x in zip(mb["clf"].indices.tolist(), mb["clf"].images, strict=True):
            images.setdefault(i, []).append(image_hash(x))
    assert all(len(h) == 2 for h in images.values())
    assert sum(h[0] != h[1] for h in images.values()) > 100
    keys_epoch0 = data.step_batch(0)[0]["in"].keys
    assert keys_epoch0.dtype == torch.int64 and len(set(keys_epoch0.tolist())) == 24


# --------------------------------------------------------------------------------------------
# Resume
# --------------------------------------------------------------------------------------------
def test_resume_yields_the_same_batches(cifar_root):
    cfg = make_cfg(cifar_root)
    plan = plan_batches(cfg.schedule, cfg.eval, 1)
    through = iter(build_train_data(cfg.inputs, Runtime(), plan, STREAMS))
    batches = [next(through) for _ in range(9)]
    resumed = iter(build_train_data(cfg.inputs, Runtime(), plan, STREAMS, start_step=6))
    for expected in batches[6:]:
        got = next(resumed)
        for stream in ("in", "clf", "out"):
            for name in ("images", "labels", "keys", "indices"):
                assert torch.equal(getattr(got[0][stream], name),
                                   getattr(expected[0][stream], name)), (stream, name)


def test_loading_leaves_the_global_rng_alone(cifar_root):
    cfg = make_cfg(cifar_root, outdist_dataset="lowfreq-noise")
    torch.manual_seed(123)
    state = torch.get_rng_state()
    next(iter(build_train_data(cfg.inputs, Runtime(), plan_batches(cfg.schedule, cfg.eval, 1), STREAMS, start_step=2)))
    next(iter(build_eval_data(cfg.data, Runtime(), batch_size=8)))
    assert torch.equal(torch.get_rng_state(), state)


def test_resume_is_o1(cifar_root, monkeypatch):
    cfg = make_cfg(cifar_root)
    plan = plan_batches(cfg.schedule, cfg.eval, 1)
    reads = []

    def timed_first_batch(start_step):
        data = build_train_data(cfg.inputs, Runtime(), plan, STREAMS, start_step=start_step)
        original = data._dataset.streams[0].source.images
        monkeypatch.setattr(data._dataset.streams[0].source, "images",
                            lambda idx: reads.append(len(idx)) or original(idx))
        t0 = time.perf_counter()
        batch = next(iter(data))
        return time.perf_counter() - t0, batch

    timed_first_batch(10)  # warm-up (imports, first augmentation)
    reads.clear()
    t_small, _ = timed_first_batch(10)
    t_large, batch = timed_first_batch(10_000)
    assert batch[0].step == 10_000 and batch[0]["in"].epoch == 10_000 // 5
    assert reads == [24, 24] * 2  # in + clf streams, one step each run: nothing replayed
    assert t_large < 3 * t_small + 0.5


# --------------------------------------------------------------------------------------------
# Augmentations
# --------------------------------------------------------------------------------------------
def test_augmentation_is_seeded_and_leaves_rng_alone(cifar_root):
    import random

    images = load_indist(make_cfg(cifar_root).data, "train").source.data[:16]
    transform = build_augmentation("autoaugment_cutout", 32)
    seeds = list(range(100, 116))
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    first = augment_batch(images, transform, seeds)
    random.seed(12345)  # Python's RNG plays no part
    second = augment_batch(images, transform, seeds)
    assert torch.equal(torch.rand(1), before)  # caller's RNG restored
    assert torch.equal(first, second)
    assert first.dtype == torch.float32 and 0 <= first.min() and first.max() <= 1
    plain = augment_batch(images, None, None)
    assert not torch.equal(first, plain)
    black = (first == 0).all(dim=1).flatten(1).sum(dim=1)  # all-black pixels per image
    assert (black >= 8 * 8).all()  # Cutout 16 px (clipped to at least 8x8) on every image


# --------------------------------------------------------------------------------------------
# Other sources
# --------------------------------------------------------------------------------------------
def test_digits_split_and_scale():
    cfg = make_cfg("/nonexistent", indist_dataset="digits", image_size=16)
    train, test = load_indist(cfg.data, "train"), load_indist(cfg.data, "test")
    assert len(train) + len(test) == 1797 and len(train) == 1438
    x, y = train[0]
    assert x.shape == (3, 16, 16) and torch.equal(x[0], x[2]) and 0 <= x.min() <= x.max() <= 1
    assert torch.equal(load_indist(cfg.data, "train").source.data, train.source.data)


def test_tinyimages_layout_exclusion_and_stream(cifar_root, tmp_path):
    path = str(tmp_path / "tiny_images.bin")
    chw = write_tiny_images(path, 300)
    raw = np.fromfile(path, dtype=np.uint8).reshape(300, 3072)
    hwc = raw[17].reshape(32, 32, 3, order="F")  # the original loaders' reading
    source = TinyImagesSource(path, 32)
    assert np.array_equal(source.images(np.array([17]))[0].permute(1, 2, 0).numpy(), hwc)

    excluded = np.array([0, 5, 6, 299])
    np.savetxt(tmp_path / "exclude.txt", excluded, fmt="%d")
    cfg = make_cfg(cifar_root, outdist_dataset="tinyimages", outdist_std_dir=str(tmp_path),
                   outdist_exclude_index=str(tmp_path / "exclude.txt"),
                   tinyimages_exclusion_dir=None)  # the original's lists: their own test file
    cfg.data.augm_type_generation = "none"
    out = load_outdist(cfg.inputs).source
    assert len(out) == 296
    kept = np.setdiff1d(np.arange(300), excluded)
    assert np.array_equal(out.record_numbers(np.arange(296)), kept)
    mb, = build_train_data(cfg.inputs, Runtime(), plan_batches(cfg.schedule, cfg.eval, 1), STREAMS).step_batch(2)
    records = out.record_numbers(mb["out"].indices.numpy())
    assert not np.isin(records, excluded).any()
    assert torch.equal(mb["out"].images, torch.from_numpy(chw[records]).float() / 255)


def test_noise_outdist_is_deterministic(cifar_root):
    for name in ("noise", "lowfreq-noise"):
        cfg = make_cfg(cifar_root, outdist_dataset=name)
        a = load_outdist(cfg.inputs)[7][0]
        assert torch.equal(a, load_outdist(cfg.inputs)[7][0]) and a.shape == (3, 32, 32)
        assert not torch.equal(a, load_outdist(cfg.inputs)[8][0])
    smooth = load_outdist(make_cfg(cifar_root, outdist_dataset="lowfreq-noise").inputs)[0][0]
    rough = load_outdist(make_cfg(cifar_root, outdist_dataset="noise").inputs)[0][0]
    assert smooth.diff(dim=-1).abs().mean() < rough.diff(dim=-1).abs().mean() / 2


@pytest.mark.parametrize("name,layout", [("a.npy", "NHWC"), ("b.npz", "NCHW"), ("c.pt", "NHWC")])
def test_image_tensor_file(tmp_path, name, layout):
    chw = write_tensor_file(str(tmp_path / name), n=5, layout=layout)
    images = image_tensor_file(str(tmp_path / name))
    assert images.dtype == torch.float32
    assert torch.equal(images, torch.from_numpy(chw).float() / 255)


def test_image_folder_sources(tmp_path):
    write_image_folder(str(tmp_path / "train"), n_per_class=3)
    write_image_folder(str(tmp_path / "test"), n_per_class=1)
    cfg = make_cfg(str(tmp_path), indist_dataset="imagefolder", num_classes=2,
                   outdist_dataset="imagefolder", outdist_std_dir=str(tmp_path / "train"))
    x, y = load_indist(cfg.data, "train", "original")[4]
    assert x.shape == (3, 32, 32) and y == 1
    assert len(load_outdist(cfg.inputs)) == 6


def test_loader_settings_on_cpu(cifar_root):
    cfg = make_cfg(cifar_root, num_workers=64)
    cores = len(os.sched_getaffinity(0))
    assert loader_workers(cfg.data, Runtime()) == cores
    assert loader_workers(cfg.data, Runtime(local_world_size=cores + 1)) == 0
    loader = build_eval_data(cfg.data, Runtime(), batch_size=4)
    assert loader.pin_memory is False


def test_only_the_declared_streams_are_loaded(cifar_root):
    """A method declaring one stream (stage 1: the classifier stream) gets that one alone, with
    the same images and keys as when all three are loaded."""
    cfg = make_cfg(cifar_root)
    plan = plan_batches(cfg.schedule, cfg.eval, 1)
    alone, = build_train_data(cfg.inputs, Runtime(), plan, (CLASSIFIER,)).step_batch(3)
    full, = build_train_data(cfg.inputs, Runtime(), plan, STREAMS).step_batch(3)
    assert list(alone) == ["clf"] and list(full) == ["in", "clf", "out"]
    for name in ("images", "labels", "keys", "indices"):
        assert torch.equal(getattr(alone["clf"], name), getattr(full["clf"], name)), name


def test_digits_are_scikit_learns_without_importing_its_datasets_module():
    """rebm reads the file scikit-learn ships (its datasets module costs 1.3 s per process to
    import); the arrays are exactly those of sklearn.datasets.load_digits."""
    from sklearn.datasets import load_digits

    from rebm.data.files import _sklearn_digits

    images, targets = _sklearn_digits()
    reference = load_digits()
    np.testing.assert_array_equal(images, reference.images)
    np.testing.assert_array_equal(targets, reference.target)
    assert images.dtype == reference.images.dtype and targets.dtype == np.int64
