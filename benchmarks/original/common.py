"""What both sides of the original-vs-rebm harness share: the run's specification, the batch
file both read, the pinned float settings, and the line protocol of a side's worker process.

This module imports torch and nothing of either `rebm` package: the original's side imports it
as a top-level module (its own `rebm` comes first on that process's path), rebm's side as
`benchmarks.original.common`.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Dict, TextIO

import torch

# The trajectory's configuration (docs/performance.md "Against the original"). Chosen to be
# cheap enough for CI on 2 cores while every piece of stage 2 still acts: WideResNet-16-4 at
# 32 px (the original's WideResNet pools 8x8 at the end, so 32 px is its smallest input), batch
# 4, T from 0 to a cap of 3 and K = 2 (a handful of attack passes per step), a curriculum
# window of 2 steps with an AUC threshold the run crosses several times, EMA on, SGD at the
# CIFAR-100 recipe's lr 0.01 so 50 steps move the weights well past float rounding.
TRAJECTORY = dict(
    model="WideResNet16x4", num_classes=10, image_size=32, batch_size=4, steps=50,
    T_start=0, T_cap=3, attack_step_size=1.0, K=2, clf_step_size=0.1, clf_eps=0.5,
    optimizer="sgd", lr=0.01, wd=5e-4, auc_threshold=0.75, window_images=8,
    ema_decay=0.999, seed=0,
)
# The speed comparison (issue 42): the CPU row, T = K = 10 fixed (the curriculum's cap).
SPEED_CPU = dict(
    TRAJECTORY, batch_size=32, steps=4, T_start=10, T_cap=10, K=10, lr=1e-3,
    auc_threshold=1.0, window_images=10**9,
)
# The GPU rows: the CIFAR recipe's WideResNet-34-10 and ResNet-50 at 256 px (ImageNet's T = 15
# negatives at step size 2.0, K = 10), both with T fixed at the cap.
SPEED_GPU_CIFAR = dict(SPEED_CPU, model="WideResNet34x10", batch_size=128)
SPEED_GPU_IMAGENET = dict(
    SPEED_CPU, model="ResNet50ImageNet", num_classes=1000, image_size=256, batch_size=32,
    T_start=15, T_cap=15, attack_step_size=2.0,
)


@dataclass
class Settings:
    """The float settings pinned equal on both sides (the original sets cudnn.benchmark = True
    in its entry point; neither code sets the TF32 switches, so torch's defaults would apply)."""

    tf32: bool = False
    cudnn_benchmark: bool = True
    float32_matmul_precision: str = "highest"

    def apply(self) -> Dict[str, object]:
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        torch.backends.cudnn.allow_tf32 = self.tf32
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        torch.set_float32_matmul_precision(self.float32_matmul_precision)
        torch.set_default_dtype(torch.float32)
        return self.read()

    @staticmethod
    def read() -> Dict[str, object]:
        """The settings as this process has them (printed by each side)."""
        return {"default_dtype": str(torch.get_default_dtype()),
                "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
                "cudnn_benchmark": torch.backends.cudnn.benchmark,
                "float32_matmul_precision": torch.get_float32_matmul_precision(),
                "threads": torch.get_num_threads(), "torch": torch.__version__}


@dataclass
class Job:
    """What a side's worker is told at start: the spec, where the shared files are, the device
    and the threads. Written as JSON on its command line."""

    spec: dict
    workdir: str
    device: str = "cpu"
    threads: int = 1
    settings: dict = field(default_factory=lambda: asdict(Settings()))
    variant: str = "default"  # rebm: "eager", "default" (a long run's defaults), "bf16"

    @property
    def batches_path(self) -> str:
        return os.path.join(self.workdir, "batches.pt")

    @property
    def weights_path(self) -> str:
        return os.path.join(self.workdir, "initial_weights.pt")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Job":
        return cls(**json.loads(text))


def window_steps(spec: dict) -> int:
    """The curriculum's window in steps, as both codes compute it from min_imgs_per_threshold."""
    return math.ceil(spec["window_images"] / spec["batch_size"])


def make_batches(spec: dict, steps: int) -> Dict[str, torch.Tensor]:
    """`steps` batches of the three streams, from the spec's seed: in-distribution images are a
    per-class smooth pattern plus noise (so a classifier and an energy can learn something),
    the classifier stream another draw of the same classes, out-distribution uniform noise.
    Values are rounded to 1/255, as decoded images are."""
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    B, S, C, H = spec["batch_size"], steps, spec["num_classes"], spec["image_size"]
    patterns = torch.rand(C, 3, 4, 4, generator=g)
    patterns = torch.nn.functional.interpolate(patterns, size=(H, H), mode="bilinear",
                                               align_corners=False)

    def indist(labels: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(*labels.shape, 3, H, H, generator=g)
        return (0.7 * patterns[labels] + 0.3 * noise).mul(255).round().div(255)

    in_labels = torch.randint(0, C, (S, B), generator=g)
    clf_labels = torch.randint(0, C, (S, B), generator=g)
    return {"in_images": indist(in_labels), "in_labels": in_labels,
            "clf_images": indist(clf_labels), "clf_labels": clf_labels,
            "out_images": torch.rand(S, B, 3, H, H, generator=g).mul(255).round().div(255)}


# ---------------------------------------------------------------------------------------------
# The worker protocol: one JSON object per line. A side keeps the real stdout for it and sends
# everything else (the original's logging and prints) to stderr.
# ---------------------------------------------------------------------------------------------
def protocol_stdout() -> TextIO:
    """A private copy of stdout for the protocol; fd 1 then points at stderr."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def serve(handlers: Dict[str, object], channel: TextIO) -> None:
    """Answer each request line {"cmd": name, ...} with handlers[name](**rest) as one line."""
    for line in sys.stdin:
        request = json.loads(line)
        cmd = request.pop("cmd")
        if cmd == "quit":
            break
        try:
            answer = {"ok": True, "result": handlers[cmd](**request)}
        except Exception as error:  # the coordinator reports it with the side's name
            import traceback

            traceback.print_exc()
            answer = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        channel.write(json.dumps(answer) + "\n")
        channel.flush()


# ---------------------------------------------------------------------------------------------
# Measurements both sides take the same way
# ---------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(step, first: int, count: int, device: torch.device) -> list:
    """Wall seconds of step(i) for i in first..first+count-1, CUDA synchronised around each."""
    import time

    seconds = []
    for index in range(first, first + count):
        sync(device)
        started = time.perf_counter()
        step(index)
        sync(device)
        seconds.append(time.perf_counter() - started)
    return seconds


def count_gflop(step) -> float:
    """GFLOP of one call of step(), by the formulas of torch's FlopCounterMode (its registry:
    matmuls and convolutions, forward and backward). FlopCounterMode itself cannot count the
    original's attacks: its module tracker's hooks fail under `torch.autograd.grad` with a leaf
    input ("A leaf node was passed to _will_engine_execute_node"), so this dispatch mode applies
    the same registry without the tracker; on a step both can count, the totals are equal."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    class Counter(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            formula = flop_registry.get(func._overloadpacket)
            if formula is not None:
                self.total += formula(*args, **(kwargs or {}), out_val=out)
            return out

    with Counter() as counter:
        step()
    return counter.total / 1e9


def peak_memory(device: str) -> Dict[str, float]:
    """This process's peak RSS and, on CUDA, peak allocated memory, in MiB."""
    import resource

    peaks = {"max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}
    if device == "cuda":
        peaks["max_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return peaks


def current_rss_mib() -> float:
    """This process's resident memory now (Linux /proc), in MiB: the baseline before a side
    builds its model, so that peak minus baseline is what training holds, comparable with the
    memory plan (which leaves out the interpreter and its libraries)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def gemm_gflops(device: torch.device, n: int = 2048, reps: int = 10) -> float:
    """Median float32 GFLOP/s of an n x n matrix product on `device` at this process's threads:
    the rate the machine's BLAS reaches on the friendliest dense workload."""
    import statistics
    import time

    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(reps):
        sync(device)
        started = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - started)
    return 2 * n**3 / statistics.median(times) / 1e9
