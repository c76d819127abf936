"""The original's AutoAugment CIFAR-10 policy on fixed images under fixed draws, stored for
tests/test_data_autoaugment.py (CI has no copy of the original).

    python -m benchmarks.original.autoaugment_outputs --mirror /path/to/DAT.git \
        [--commit fb2ffc7] [--out tests/data/original_autoaugment.npz]

It runs the original's own file, InNOutRobustness/utils/datasets/augmentations/autoaugment.py,
taken from a `git archive` of the mirror (the file imports only PIL, numpy and random), with
`CIFAR10Policy(fillcolor=(0, 0, 0))` as DAT builds it (rebm/training/data.py:52-56 with
cifar_augmentation.py:22, 58 there). Its draws come from Python's `random` (the module's
`random.randint`, `random.random`, `random.choice`); the script replaces that module, inside the
loaded file only, by a script of chosen values, so each case fixes the sub-policy, whether each
operation applies (uniform 0.0: applies when its probability is above 0; 0.99999: does not) and
the signs. Every sub-policy gets four cases: both operations with signs (-1, -1), both with
(+1, +1), the first alone, the second alone.

Stored: the images, the draws, the outputs, the original's probabilities and magnitudes per
sub-policy, and the versions of Pillow and numpy that computed them.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import tarfile
import tempfile
from io import BytesIO

import numpy as np

POLICY_FILE = "InNOutRobustness/utils/datasets/augmentations/autoaugment.py"
APPLY, SKIP = 0.0, 0.99999


class ScriptedRandom:
    """Stands for the `random` module inside the original's file: returns the chosen values."""

    def __init__(self, index: int, uniforms, signs):
        self.index, self.uniforms, self.signs = index, list(uniforms), list(signs)

    def randint(self, low, high):
        assert (low, high) == (0, 24), (low, high)
        return self.index

    def random(self):
        return self.uniforms.pop(0)

    def choice(self, values):
        assert list(values) == [-1, 1], values
        return self.signs.pop(0)


def fixed_images(size: int = 32) -> np.ndarray:
    """Four HWC uint8 images: uniform noise (every value, so each solarize threshold shows), a
    smooth gradient with noise in [30, 200] and a low-contrast image (autocontrast and equalize
    act), 8x8 blocks of colour (edges for the nearest and bicubic resamplings)."""
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (size, size, 3))
    ramp = np.linspace(0, 1, size)
    smooth = 30 + 170 * (ramp[:, None, None] * 0.6 + ramp[None, :, None] * 0.4)
    smooth = smooth + rng.normal(0, 6, (size, size, 3))
    dull = 100 + 60 * rng.random((size, size, 3)) + np.array([0, 10, -15])
    blocks = np.kron(rng.integers(0, 256, (size // 8, size // 8, 3)), np.ones((8, 8, 1)))
    images = np.stack([noise, smooth, dull, blocks])
    return np.clip(np.round(images), 0, 255).astype(np.uint8)


def load_original(mirror: str, commit: str, workdir: str):
    """The original's autoaugment.py from `git archive COMMIT` of the mirror, as a module."""
    archive = subprocess.run(["git", "-C", mirror, "archive", commit, POLICY_FILE],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(workdir, filter="data")
    spec = importlib.util.spec_from_file_location("original_autoaugment",
                                                  os.path.join(workdir, POLICY_FILE))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_cases(module, images: np.ndarray):
    from PIL import Image

    policy = module.CIFAR10Policy(fillcolor=(0, 0, 0))
    index, image_index, uniforms, signs, outputs = [], [], [], [], []
    cases = [((APPLY, APPLY), (-1, -1)), ((APPLY, APPLY), (1, 1)),
             ((APPLY, SKIP), (-1, -1)), ((SKIP, APPLY), (1, 1))]
    for k in range(len(policy.policies)):
        for c, (u, s) in enumerate(cases):
            module.random = ScriptedRandom(k, u, s)
            image_index.append((k + c) % len(images))
            image = Image.fromarray(images[image_index[-1]])
            outputs.append(np.asarray(policy(image).convert("RGB")))
            assert not module.random.uniforms, "every uniform is drawn"
            index.append(k)
            uniforms.append(u)
            signs.append(s)
    table = [(p.p1, p.p2, float(p.magnitude1), float(p.magnitude2)) for p in policy.policies]
    return (np.array(index), np.array(image_index), np.array(uniforms), np.array(signs), np.stack(outputs),
            np.array(table, dtype=np.float64))


def main() -> None:
    import PIL

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirror", required=True, help="a git clone of xuwangyin/DAT")
    parser.add_argument("--commit", default="fb2ffc7")
    parser.add_argument("--out", default="tests/data/original_autoaugment.npz")
    args = parser.parse_args()
    images = fixed_images()
    with tempfile.TemporaryDirectory() as workdir:
        module = load_original(args.mirror, args.commit, workdir)
        index, image_index, uniforms, signs, outputs, table = run_cases(module, images)
    np.savez_compressed(args.out, images=images, index=index, image=image_index,
                        uniforms=uniforms, signs=signs,
                        outputs=outputs, policy=table, commit=args.commit,
                        pillow=PIL.__version__, numpy=np.__version__)
    print(f"{len(index)} cases of the original's policy at {args.commit} (Pillow "
          f"{PIL.__version__}, numpy {np.__version__}) -> {args.out}")


if __name__ == "__main__":
    main()
