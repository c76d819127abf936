"""The files a run-level twin reads (benchmarks/original/run_twin.py), written once and read by
both codes through their own loaders, and the shared stage-1 checkpoint and feature network.

- in-distribution: scikit-learn's bundled digits at 32 px (rebm.data.files.load_digits' split
  and resize), written in CIFAR-10's python format (`cifar-10-batches-py/`), so each side reads
  them as CIFAR-10 (torchvision's CIFAR10 in the original, rebm's CIFAR reader);
- out-distribution: `tiny_images.bin` in 80M TinyImages' record layout (3072 bytes per record,
  channel-major, column-major inside a channel) of smooth colour patterns, with the original's
  six exclusion lists for it (tests/fake_data.py writes them: their names, 1- and 0-based);
- the seed images of the samples: a float tensor file, as the recipes' cifar_fid_imgs_50K.pt;
- the stage-1 checkpoint: a WideResNet trained here by plain SGD on the digits (the same file
  for every run of both codes; stage 2 starts from it as the recipes start from stage 1's);
- the feature network of the samples' FID: that stage-1 network's pooled features (64 for
  WideResNet-10-1), computed by the same code for both sides' samples after the runs.
"""

from __future__ import annotations

import os
import pickle
from typing import Dict

import numpy as np
import torch
import torch.nn.functional as F

CIFAR_FOLDER = "cifar-10-batches-py"
LABEL_NAMES = [str(d) for d in range(10)]


def write_digits_as_cifar(root: str) -> Dict[str, int]:
    """digits train/test at 32 px as CIFAR-10's five data batches, test batch and meta."""
    from rebm.data.files import load_digits

    folder = os.path.join(root, CIFAR_FOLDER)
    os.makedirs(folder, exist_ok=True)
    counts = {}
    for split, train in (("train", True), ("test", False)):
        source = load_digits(32, train)
        rows = source.data.reshape(len(source.data), 3072).numpy()  # CHW, channel-major
        labels = source.targets.tolist()
        counts[split] = len(labels)
        chunks = np.array_split(np.arange(len(labels)), 5) if train else [np.arange(len(labels))]
        for number, chunk in enumerate(chunks, start=1):
            name = f"data_batch_{number}" if train else "test_batch"
            _dump(os.path.join(folder, name), {
                "batch_label": name, "labels": [labels[i] for i in chunk],
                "data": np.ascontiguousarray(rows[chunk]),
                "filenames": [f"{split}_{i}.png" for i in chunk]})
    _dump(os.path.join(folder, "batches.meta"), {
        "num_cases_per_batch": counts["train"] // 5 + 1, "label_names": LABEL_NAMES,
        "num_vis": 3072})
    return counts


def _dump(path: str, obj: dict) -> None:
    with open(path, "wb") as fh:
        pickle.dump(obj, fh, protocol=2)  # CIFAR's files are Python-2 pickles


def smooth_images(n: int, seed: int) -> torch.Tensor:
    """n colour images at 32 px, [0, 1]: a random 4x4 colour field upsampled, plus a little
    pixel noise (image-like, unlike white noise), rounded to 8 bits."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, 4, 4, generator=g)
    images = F.interpolate(low, size=(32, 32), mode="bilinear", align_corners=False)
    images = 0.85 * images + 0.15 * torch.rand(n, 3, 32, 32, generator=g)
    return images.mul(255).round().div(255)


def write_tinyimages(folder: str, n_records: int, seed: int) -> int:
    """tiny_images.bin of n_records smooth images and the six exclusion lists beside it (in
    `folder`/TinyImagesExclusionIdcs); returns how many records the lists exclude."""
    from tests.fake_data import write_tinyimages_exclusion_lists

    os.makedirs(folder, exist_ok=True)
    chw = smooth_images(n_records, seed).mul(255).round().to(torch.uint8).numpy()
    # record layout: reshape(32, 32, 3, order="F") of HWC = channel, column, row
    chw.transpose(0, 1, 3, 2).reshape(n_records, 3072).tofile(
        os.path.join(folder, "tiny_images.bin"))
    excluded = write_tinyimages_exclusion_lists(
        os.path.join(folder, "TinyImagesExclusionIdcs"), n_records, seed)
    return len(excluded)


def write_seed_images(path: str, n: int, seed: int) -> None:
    torch.save(smooth_images(n, seed), path)


def train_stage1(spec: dict, root: str, path: str) -> Dict[str, float]:
    """The stage-1 checkpoint: rebm's WideResNet (CIFAR-10 input statistics, as both codes
    normalise cifar10-conditional), SGD on the digits with random crops, the weights saved as a
    plain state dict (both codes' checkpoint loaders read it). Returns its test accuracy."""
    from rebm.data.files import load_digits
    from rebm.models import build_model, dataset_stats

    torch.manual_seed(spec["seed"])
    mean, std = dataset_stats("cifar10")
    model = build_model(spec["model"], 10, mean=mean, std=std)
    train, test = load_digits(32, True), load_digits(32, False)
    images, labels = train.data.float() / 255, train.targets
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    g = torch.Generator().manual_seed(spec["seed"])
    model.train()
    for _ in range(spec["stage1_steps"]):
        index = torch.randint(0, len(labels), (64,), generator=g)
        shift = torch.randint(-3, 4, (2,), generator=g).tolist()
        batch = torch.roll(images[index], shifts=shift, dims=(2, 3))
        loss = F.cross_entropy(model(batch), labels[index])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    torch.save(model.state_dict(), path)
    with torch.no_grad():
        accuracy = (model(test.data.float() / 255).argmax(1) == test.targets).float().mean()
    return {"stage1_test_accuracy": float(accuracy)}


class FeatureNetwork:
    """The stage-1 network's pooled features (the input of its last linear layer): the one
    feature network both sides' samples are measured with, and its classifier's labels."""

    def __init__(self, spec: dict, checkpoint: str):
        from rebm.models import build_model, dataset_stats

        mean, std = dataset_stats("cifar10")
        self.model = build_model(spec["model"], 10, mean=mean, std=std)
        self.model.load_state_dict(torch.load(checkpoint))
        self.model.eval()
        self.head = [m for m in self.model.modules() if isinstance(m, torch.nn.Linear)][-1]

    @torch.no_grad()
    def __call__(self, images: torch.Tensor):
        """(features float64, predicted class) of float [0, 1] images."""
        kept = []
        hook = self.head.register_forward_hook(lambda m, inputs, out: kept.append(inputs[0]))
        try:
            logits = torch.cat([self.model(chunk) for chunk in images.float().split(256)])
        finally:
            hook.remove()
        return torch.cat(kept).double(), logits.argmax(1)


def frechet_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """FID's formula on two feature sets (rows), in float64."""
    from scipy import linalg

    mu_a, mu_b = a.mean(0).numpy(), b.mean(0).numpy()
    cov_a, cov_b = np.cov(a.numpy(), rowvar=False), np.cov(b.numpy(), rowvar=False)
    root, _ = linalg.sqrtm(cov_a @ cov_b, disp=False)
    if not np.isfinite(root).all():
        eye = np.eye(len(cov_a)) * 1e-6
        root = linalg.sqrtm((cov_a + eye) @ (cov_b + eye))
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a + cov_b - 2 * root.real))
