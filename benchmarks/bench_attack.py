"""Cost of one PGD step (input-only gradient) relative to one training forward+backward.

    .venv/bin/python benchmarks/bench_attack.py [--reps 20] [--threads 2]

An attack step needs the gradient w.r.t. the input only, so the autograd engine skips every
weight-gradient kernel; a training step needs the weight gradients but not the input gradient.
The ratio printed is median(attack step) / median(forward + backward with parameter grads),
batch 32 at 32x32, model in eval mode (frozen BatchNorm, as DAT trains with use_batchnorm: false).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from torch import nn

from rebm.attacks import pgd_attack


class PreActBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.bn1, self.bn2 = nn.BatchNorm2d(c_in), nn.BatchNorm2d(c_out)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.shortcut = None if c_in == c_out else nn.Conv2d(c_in, c_out, 1, stride, bias=False)

    def forward(self, x):
        o = F.relu(self.bn1(x))
        y = self.conv2(F.relu(self.bn2(self.conv1(o))))
        return y + (x if self.shortcut is None else self.shortcut(o))


class TinyPreActResNet(nn.Module):
    """Fallback when rebm.models is unavailable: a WRN-10-1-like pre-activation net."""

    def __init__(self, width: int = 16, num_classes: int = 10):
        super().__init__()
        w = [width, width, 2 * width, 4 * width]
        self.conv1 = nn.Conv2d(3, w[0], 3, 1, 1, bias=False)
        self.blocks = nn.Sequential(
            *(PreActBlock(w[i], w[i + 1], 1 if i == 0 else 2) for i in range(3))
        )
        self.bn, self.fc = nn.BatchNorm2d(w[-1]), nn.Linear(w[-1], num_classes)

    def forward(self, x, y=None):
        h = F.relu(self.bn(self.blocks(self.conv1(x))))
        logits = self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))
        return logits if y is None else logits[torch.arange(len(x)), y]


def models():
    try:
        from rebm.models import build_model

        for name in ("WideResNet10x1", "WideResNet16x2"):
            yield name, build_model(name, num_classes=10)
    except Exception as err:  # models package missing or its API changed
        print(f"rebm.models unavailable ({type(err).__name__}: {err}); using the fallback only")
    yield "TinyPreActResNet(16)", TinyPreActResNet()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_fns(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Dict[str, Callable]:
    """The three things compared, on one batch: a PGD step (input gradient only), a training
    forward + backward (parameter gradients), a forward alone."""
    def attack_step():
        pgd_attack(model, x, steps=1, step_size=0.1, objective="logit", y=y)

    def train_step():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    def forward_only():
        with torch.no_grad():
            model(x)

    return {"attack": attack_step, "train": train_step, "fwd": forward_only}


def interleaved_times(fns: Dict[str, Callable], reps: int, warmup: int, device: torch.device
                      ) -> Dict[str, List[float]]:
    """Seconds of each function per repetition, the functions interleaved within a repetition
    so background load hits all alike; the first `warmup` repetitions are not kept."""
    times: Dict[str, List[float]] = {k: [] for k in fns}
    for rep in range(warmup + reps):
        for key, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if rep >= warmup:
                times[key].append(time.perf_counter() - t0)
    return times


def paired_ratio(times: Dict[str, List[float]]) -> float:
    """Median over repetitions of attack time / training time."""
    return statistics.median(a / t for a, t in zip(times["attack"], times["train"], strict=True))


def bench(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, reps: int) -> None:
    model.eval()
    times = interleaved_times(step_fns(model, x, y), reps, 3, x.device)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"{name:22s} attack step {1e3 * med['attack']:8.2f} ms | fwd+bwd(params) "
        f"{1e3 * med['train']:8.2f} ms | fwd {1e3 * med['fwd']:8.2f} ms | "
        f"attack/train {med['attack'] / med['train']:.3f} (median of paired ratios "
        f"{paired_ratio(times):.3f})"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    x = torch.rand(args.batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    print(
        f"torch {torch.__version__}, {device}, {args.threads} threads, batch {args.batch} at 32x32"
    )
    for name, model in models():
        bench(name, model.to(device), x, y, args.reps)


if __name__ == "__main__":
    main()
