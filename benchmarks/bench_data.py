"""Data pipeline benchmark (not a test): prints its figures.

1. Loader throughput on CIFAR-shaped fake data (real on-disk format): the classification
   augmentation alone (autoaugment_cutout, images/s) and the full three-stream training loader
   (global batches/s and images/s over all three streams) for several worker counts; medians of
   several repetitions.
2. 80M TinyImages: a SPARSE tiny_images.bin of 80M x 3072 bytes (truncate, nothing written) —
   time to the first global batch of the out-distribution stream and of the whole pipeline, and
   the extra resident memory (targets: < 10 s, < 1 GiB).
3. JPEG pipeline (ImageNet / OpenImage-O): images/s that ONE loader worker (one process, one
   thread) decodes and augments at 224 px, on generated JPEGs of ImageNet-like size (500x375,
   quality 90, ~110 KB): decode alone, and decode + each augmentation through the real source
   (`FullImageSource.read`, seeded per sample). A loader with W workers delivers about W times
   this, while the cores last.

    .venv/bin/python benchmarks/bench_data.py [--reps 5] [--steps 20] [--dir /tmp]
   With --resnet50-step T: for comparison, the images/s a real DAT step of ResNet50ImageNet
   (the ResNet-50 config: K = 3 for the classifier's attack, frozen BatchNorm, channels_last)
   consumes on this CPU at T PGD steps per negative: one warm-up step, then timed steps on
   batches decoded beforehand; it consumes 3 images per global-batch position.

    .venv/bin/python benchmarks/bench_data.py --jpeg-only [--jpeg-size 224] [--resnet50-step 10 --resnet50-batch 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from rebm.config import TrainConfig, plan_batches  # noqa: E402
from rebm.data import (  # noqa: E402
    CLASSIFIER,
    INDIST,
    OUTDIST,
    build_train_data,
    load_indist,
    outdist_source,
)
from rebm.data.augmentations import augment_batch, build_augmentation  # noqa: E402
from rebm.data.imagenet import FullImageSource, PathTable, decode_rgb  # noqa: E402
from rebm.data.indexing import StreamSchedule  # noqa: E402
from rebm.distributed import Runtime  # noqa: E402
from rebm.standin.writers import write_fake_cifar10  # noqa: E402

STREAMS = (INDIST, CLASSIFIER, OUTDIST)  # the three streams DAT reads
TINY_RECORDS = 80_000_000


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_cfg(root: str, batch_size: int, workers: int) -> TrainConfig:
    cfg = TrainConfig()
    cfg.data.indist_dataset = "cifar10"
    cfg.data.indist_ds_dir = root
    cfg.data.num_workers = workers
    cfg.schedule.batch_size = batch_size
    return cfg


def bench_augmentation(root: str, reps: int, batch: int = 256) -> float:
    images = load_indist(make_cfg(root, 128, 0).data, "train").source.data[:batch]
    transform = build_augmentation("autoaugment_cutout", 32)
    rates = []
    for rep in range(reps):
        seeds = np.arange(rep * batch, (rep + 1) * batch)
        t0 = time.perf_counter()
        augment_batch(images, transform, seeds)
        rates.append(batch / (time.perf_counter() - t0))
    return statistics.median(rates)


def bench_loader(root: str, workers: int, reps: int, steps: int, batch_size: int) -> tuple:
    cfg = make_cfg(root, batch_size, workers)
    data = build_train_data(cfg.inputs, Runtime(), plan_batches(cfg.schedule, cfg.eval, 1), STREAMS)
    rates = []
    for _ in range(reps):
        loader = iter(data)
        next(loader)  # worker start-up and first prefetch are not throughput
        t0 = time.perf_counter()
        for _ in range(steps):
            next(loader)
        rates.append(steps / (time.perf_counter() - t0))
        del loader
    steps_per_s = statistics.median(rates)
    return steps_per_s, steps_per_s * batch_size * 3, data._loader_kwargs["num_workers"]


def bench_tinyimages(cifar_root: str, work_dir: str, batch_size: int) -> None:
    path = os.path.join(work_dir, "tiny_images.bin")
    with open(path, "wb") as f:
        f.truncate(TINY_RECORDS * 3072)  # sparse: no data blocks are written
    try:
        cfg = make_cfg(cifar_root, batch_size, 0)
        cfg.data.outdist_dataset = "80m-tinyimages"
        cfg.data.outdist_std_dir = work_dir
        cfg.data.tinyimages_exclusion_dir = None  # a sparse file of zeros: nothing to exclude
        rss0 = rss_bytes()
        t0 = time.perf_counter()
        source = outdist_source(cfg.inputs)
        schedule = StreamSchedule(len(source), batch_size, cfg.schedule.rand_seed, "out")
        indices, _ = schedule.rank_indices(0, 0, 1, 0, batch_size)
        images = source.images(indices)
        t_out = time.perf_counter() - t0
        rss_out = rss_bytes() - rss0
        assert images.shape == (batch_size, 3, 32, 32)

        t0 = time.perf_counter()
        data = build_train_data(cfg.inputs, Runtime(), plan_batches(cfg.schedule, cfg.eval, 1), STREAMS,
                                start_step=123_456)
        next(iter(data))
        t_all = time.perf_counter() - t0
        rss_all = rss_bytes() - rss0
        print(f"80M TinyImages ({len(source):,} records, sparse {TINY_RECORDS * 3072 / 2**30:.0f}"
              f" GiB file), global batch {batch_size}:")
        print(f"  out-dist stream, open + first batch: {t_out * 1e3:.1f} ms, "
              f"extra RSS {rss_out / 2**20:.1f} MiB")
        print(f"  whole pipeline (CIFAR + TinyImages), build + first batch at step 123,456: "
              f"{t_all:.2f} s, extra RSS {rss_all / 2**20:.1f} MiB (includes CIFAR in memory)")
        ok = t_all < 10 and rss_all < 2**30
        print(f"  targets < 10 s and < 1 GiB: {'met' if ok else 'MISSED'}")
    finally:
        os.remove(path)


def write_imagenet_like_jpegs(folder: str, n: int, seed: int = 0) -> list:
    """n JPEGs of 500x375 (ImageNet's typical size): smooth colour blocks plus pixel noise, which
    compresses at quality 90 to about the size of a real ImageNet JPEG."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        blocks = rng.integers(0, 256, size=(375 // 25, 500 // 25, 3)).astype(np.uint8)
        base = np.asarray(Image.fromarray(blocks).resize((500, 375), Image.BICUBIC), np.int16)
        noisy = np.clip(base + rng.normal(0, 10, size=base.shape), 0, 255).astype(np.uint8)
        path = os.path.join(folder, f"{i:05d}.JPEG")
        Image.fromarray(noisy).save(path, format="JPEG", quality=90)
        paths.append(path)
    return paths


def bench_jpeg(work_dir: str, reps: int, size: int, n: int = 64) -> None:
    folder = os.path.join(work_dir, "jpeg")
    os.makedirs(folder, exist_ok=True)
    paths = write_imagenet_like_jpegs(folder, n)
    mean_kb = statistics.mean(os.path.getsize(p) for p in paths) / 1024
    source = FullImageSource(PathTable(folder, paths), None, size, "bench")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what one DataLoader worker runs with (pipeline._worker_init)
    try:
        rates = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for path in paths:
                decode_rgb(path)
            rates.append(n / (time.perf_counter() - t0))
        print(f"JPEG pipeline, one worker (1 thread), {n} JPEGs of 500x375, mean {mean_kb:.0f} KB"
              f", {size} px (median of {reps}):")
        print(f"  decode only: {statistics.median(rates):,.0f} images/s")
        indices = np.arange(n)
        for name in ("test", "generation_id", "generation_id_randomcrop", "default", "madry"):
            transform = build_augmentation(name, size, full_images=True)
            rates = []
            for rep in range(reps):
                seeds = np.arange(rep * n, (rep + 1) * n)
                t0 = time.perf_counter()
                source.read(indices, transform, seeds)
                rates.append(n / (time.perf_counter() - t0))
            print(f"  decode + {name}: {statistics.median(rates):,.0f} images/s")
    finally:
        torch.set_num_threads(threads)


def bench_resnet50_step(work_dir: str, size: int, outdist_steps: int, batch: int = 4,
                        timed_steps: int = 2) -> None:
    """A real DAT step (tests.steps.dat_update, the Trainer's update: T-step negatives, the classifier's
    K-step attack of the config, the fused loss forward/backward, the optimizer) of
    ResNet50ImageNet with the ResNet-50 config's options, on batches the real pipeline decoded
    from ImageNet-sized JPEGs beforehand (so the time is the step's alone); one warm-up step,
    then the median of `timed_steps`. Three classes instead of 1000: the head is 0.1% of the
    work."""
    from rebm import distributed as rd
    from rebm.config import load_config
    from rebm.distributed.precision import Precision
    from rebm.engine.build import build_model_all_ranks
    from rebm.engine.optimizers import build_optimizer
    from rebm.methods.dat.dat import DAT
    from rebm.standin.writers import write_fake_imagenet, write_fake_openimage_o
    from tests.steps import dat_update

    steps = 1 + timed_steps
    imagenet = write_fake_imagenet(os.path.join(work_dir, "ImageNet"), num_classes=3,
                                   n_train=-(-steps * batch // 3), n_val=1, height=375, width=500)
    openimages = write_fake_openimage_o(os.path.join(work_dir, "OpenImageO"), n=steps * batch,
                                        height=375, width=500)
    runtime = rd.setup_distributed(use_ddp=False)
    cfg = load_config(os.path.join(ROOT, "experiments", "imagenet", "dat_resnet50_224px.yaml"), [
        f"data.indist_ds_dir={imagenet}", f"data.outdist_std_dir={openimages}",
        "data.num_classes=3", f"data.image_size={size}", "data.num_workers=0",
        f"batch_size={batch}", "model.ckpt_path=null", "openimages_max_samples=null"])
    plan = plan_batches(cfg.schedule, cfg.eval, runtime.world_size)
    torch.manual_seed(0)
    model, raw = build_model_all_ranks(cfg.network, runtime)
    optimizer = build_optimizer(cfg.optimization, raw.parameters())
    data = iter(build_train_data(cfg.inputs, runtime, plan, DAT.streams))
    batches = [next(data) for _ in range(steps)]
    precision = Precision(cfg.distributed.amp, runtime.device)
    times = []
    for micro_batches in batches:
        t0 = time.perf_counter()
        dat_update(model, optimizer, micro_batches, outdist_steps, cfg, plan, precision)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[1:])
    images = 3 * batch  # in-distribution, classifier and out-distribution streams
    print(f"ResNet50ImageNet DAT step at {size} px on this CPU ({torch.get_num_threads()} "
          f"threads, channels_last={cfg.model.channels_last}), batch {batch}, "
          f"T={outdist_steps}, K={cfg.method.indist_attack_clf.max_steps}: {step_s:.1f} s per step "
          f"(median of {timed_steps}, after a warm-up of {times[0]:.1f} s) = "
          f"{images / step_s:.2f} images/s over the 3 streams")
    rd.teardown(runtime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--n-train", type=int, default=5000)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--dir", default=None, help="where to put temporary files")
    parser.add_argument("--jpeg-size", type=int, default=224, help="image_size of section 3")
    parser.add_argument("--jpeg-only", action="store_true", help="run only section 3")
    parser.add_argument("--resnet50-step", type=int, default=None, metavar="T",
                        help="also time a real ResNet-50 DAT step at T steps per negative")
    parser.add_argument("--resnet50-batch", type=int, default=4, help="its global batch")
    args = parser.parse_args()

    print(f"torch {torch.__version__}, {len(os.sched_getaffinity(0))} cores, "
          f"torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        if args.resnet50_step is not None:
            bench_resnet50_step(tmp, args.jpeg_size, args.resnet50_step,
                                args.resnet50_batch)
        if args.jpeg_only:
            bench_jpeg(tmp, args.reps, args.jpeg_size)
            return
        write_fake_cifar10(tmp, n_train=args.n_train, n_test=100)
        rate = bench_augmentation(tmp, args.reps)
        print(f"autoaugment_cutout, one process: {rate:,.0f} images/s (median of {args.reps})")
        for workers in args.workers:
            steps_per_s, images_per_s, used = bench_loader(
                tmp, workers, args.reps, args.steps, args.batch_size)
            print(f"training loader, num_workers={used}: {steps_per_s:.2f} global batches/s of "
                  f"{args.batch_size} = {images_per_s:,.0f} images/s over 3 streams "
                  f"(original + autoaugment_cutout + uniform noise; median of {args.reps})")
        bench_tinyimages(tmp, tmp, args.batch_size)
        bench_jpeg(tmp, args.reps, args.jpeg_size)


if __name__ == "__main__":
    main()
