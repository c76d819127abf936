"""Class-conditional samples: PGD ascent on f_y(x) from fixed seed images (docs/design.md §1).

Sample i starts from seed image i with target label i % num_classes (balanced classes), and runs
`image_log.num_steps` steps of `image_log.step_size` inside radius `image_log.eps`: L2
normalised-gradient steps in an L2 ball, or with `image_log.norm: Linf` sign steps in an Linf box.

Seeds (`image_log.seed_images`):
- "noise": uniform [0, 1] noise that is a pure function of (rand_seed, i) — the same on any world
  size and in any batch; "lowfreq-noise": the same at 1/4 resolution, upsampled bilinearly;
  "gaussian": a normal distribution fitted to the training images (mean, full covariance),
  sampled from the same per-index keys;
- a .pt/.npz/.npy image tensor file, or a folder of images: image i is seed i (cycled when there
  are fewer seeds than samples), at data.image_size. A folder is read as the original's
  compute_fid reads its seed folder (torchvision ImageFolder + Resize((S, S)) + ToTensor): files
  in sorted order, each decoded as RGB and resized to S x S by PIL's bilinear filter (no crop,
  the aspect ratio is not kept).
With `image_log.blur_fid_seeds: true` (rebm's option; the original never blurs its FID seeds) and
`image_log.blur_kernel_size` k > 0 every seed is then blurred by a k x k Gaussian (sigma by
torchvision's default rule for k, reflect padding); `adaptive_blur` first scales k by
data.image_size / 32 and rounds it to the nearest odd size. The blur is a pure function of each
image, so seeds stay a function of the sample index alone.

Evaluation generates the samples in chunks of one evaluation batch, chunk k (samples
[k·B, (k+1)·B)) on rank k % W, and hands each chunk to the metrics (rebm/eval/sampling/samples.py): a
sample's seed, label and batch neighbours depend on its index only, so the samples are the same
on any world size, and no rank ever holds all of them.

Unconditional samples ascend logsumexp_k f_k(x) (the energy) instead of f_y(x) (their labels only
lay out the grid): with `eval.unconditional_samples: true`, or, when it is null (the default),
with `logsumexp_sampling: true`, as the original's compute_fid passes logsumexp_sampling to its
generation (`sampling_mode`).
"""

from __future__ import annotations

import logging
import os
from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn
from torchvision.utils import make_grid

from rebm.attacks.pgd import keyed_normal, keyed_uniform, pgd_attack
from rebm.config.loading import GAUSSIAN_SEED_MAX_IMAGE_SIZE
from rebm.config.views import EvaluationSection
from rebm.data.files import image_tensor_file, list_image_files
from rebm.data.indexing import sample_keys
from rebm.data.pipeline import indist_source
from rebm.distributed import Runtime
from rebm.distributed.parallel import unwrap
from rebm.errors import UserError
from rebm.eval.files import write_replacing
from rebm.eval.metric import SampleChunk

LOGGER = logging.getLogger("rebm")

SEED_PURPOSE = 2  # sample_keys salt for seed noise, distinct from attack starts and augmentation
NOISE_SEEDS = ("noise", "lowfreq-noise", "gaussian")
GAUSSIAN_FIT_IMAGES = 5000  # enough for a stable covariance, cheap even at CIFAR size
GAUSSIAN_MAX_IMAGE_SIZE = GAUSSIAN_SEED_MAX_IMAGE_SIZE  # also checked with the config


_GAUSSIANS: dict = {}  # (dataset, root, size) -> (mean, Cholesky factor), fitted once


def fitted_gaussian(evaluation: EvaluationSection) -> Tuple[Tensor, Tensor]:
    """(mean, Cholesky factor of the covariance) of the flattened in-distribution training
    images (the first GAUSSIAN_FIT_IMAGES of them), fitted once per dataset and size."""
    data = evaluation.data
    key = (data.indist_dataset, data.indist_ds_dir, data.image_size)
    if key not in _GAUSSIANS:
        source = indist_source(evaluation.data, "train")
        images = source.images(np.arange(min(GAUSSIAN_FIT_IMAGES, len(source))))
        flat = (images.double() / 255.0 if images.dtype == torch.uint8 else images.double())
        flat = flat.flatten(1)
        cov = torch.cov(flat.T) + 1e-4 * torch.eye(flat.shape[1], dtype=torch.float64)
        _GAUSSIANS[key] = (flat.mean(0), torch.linalg.cholesky(cov))
    return _GAUSSIANS[key]


class SeedImageError(UserError, ValueError):
    """`image_log.seed_images` points at nothing usable; the message names the path."""


def _resize(images: Tensor, size: int) -> Tensor:
    if images.shape[-2:] == (size, size):
        return images
    return F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False,
                         antialias=True).clamp(0.0, 1.0)


def seed_blur_kernel_size(evaluation: EvaluationSection) -> int:
    """The blur of the evaluation samples' seeds: `blur_kernel_size(evaluation)` with
    `image_log.blur_fid_seeds`, else 0 (the original never blurs its FID seeds)."""
    return blur_kernel_size(evaluation) if evaluation.image_log.blur_fid_seeds else 0


def blur_kernel_size(evaluation: EvaluationSection) -> int:
    """The seeds' Gaussian kernel size: `image_log.blur_kernel_size` (0 = no blur), with
    `adaptive_blur` scaled by data.image_size / 32 and rounded to the nearest odd size (a tie goes
    up): 2 * floor(k * S / 64) + 1, exact in integers. k=5 gives 5 at 32 px and 35 at 224 px."""
    k = evaluation.image_log.blur_kernel_size
    if k <= 0 or not evaluation.image_log.adaptive_blur:
        return max(k, 0)
    return 2 * (k * evaluation.data.image_size // 64) + 1


def gaussian_kernel1d(size: int) -> Tensor:
    """Normalised 1-D Gaussian of odd `size` taps; sigma = 0.3 * ((size - 1) / 2 - 1) + 0.8, the
    rule torchvision's gaussian_blur (and OpenCV) use when no sigma is given."""
    sigma = 0.3 * ((size - 1) * 0.5 - 1) + 0.8
    half = (size - 1) * 0.5
    pdf = torch.exp(-0.5 * (torch.linspace(-half, half, size) / sigma).pow(2))
    return pdf / pdf.sum()


def _reflect(positions: Tensor, n: int) -> Tensor:
    """Reflect-padding source index of each position (edge not repeated, as F.pad 'reflect'),
    for any distance outside [0, n)."""
    if n == 1:
        return torch.zeros_like(positions)
    period = 2 * (n - 1)
    folded = positions.remainder(period)
    return torch.where(folded < n, folded, period - folded)


def gaussian_blur(images: Tensor, kernel_size: int) -> Tensor:
    """(B, C, H, W) images blurred by a separable kernel_size x kernel_size Gaussian with reflect
    padding (torchvision's gaussian_blur up to rounding; kernels wider than the image allowed).
    Element-wise sums in a fixed order: each image's result is the same in any batch."""
    if kernel_size <= 1:
        return images
    taps = gaussian_kernel1d(kernel_size).to(images.dtype).tolist()
    radius = kernel_size // 2
    for dim in (-1, -2):  # along the width, then the height
        n = images.shape[dim]
        positions = torch.arange(n, device=images.device)
        out = torch.zeros_like(images)
        for j, weight in enumerate(taps):
            out = out + weight * images.index_select(dim, _reflect(positions + j - radius, n))
        images = out
    return images


class SeedFolder:
    """Seed images from files as the original reads its seed folder: torchvision's ImageFolder
    loader (PIL, RGB) and `Resize((S, S))`, which on a PIL image is PIL's bilinear resize to
    S x S (a no-op at S x S); uint8 (k, 3, S, S), so k / 255 is what ToTensor gives."""

    def __init__(self, files, size: int):
        self.files, self.size = list(files), size

    def __len__(self) -> int:
        return len(self.files)

    def _decode(self, path: str) -> Tensor:
        try:
            with Image.open(path) as img:
                rgb = img.convert("RGB")
        except OSError as err:
            raise SeedImageError(f"image_log.seed_images: cannot decode {path} "
                                 f"({str(err).splitlines()[0] if str(err) else err})") from None
        if rgb.size != (self.size, self.size):
            rgb = rgb.resize((self.size, self.size), Image.BILINEAR)
        return torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1)

    def images(self, indices: np.ndarray) -> Tensor:
        return torch.stack([self._decode(self.files[int(i)]) for i in indices])


class SeedImages:
    """Seed image i (float [0, 1], 3 x S x S) for any index i, from the configured source, blurred
    when blur_kernel_size > 1 (see `blur_kernel_size(evaluation)` for the configured size)."""

    def __init__(self, spec: str, image_size: int, rand_seed: int,
                 evaluation: Optional[EvaluationSection] = None, blur_kernel_size: int = 0):
        self.spec = spec
        self.blur_kernel_size = blur_kernel_size
        self.evaluation = evaluation  # "gaussian" seeds: fitted to its in-distribution train set
        self.size = image_size
        self.rand_seed = rand_seed
        self._tensor: Optional[Tensor] = None  # tensor-file seeds, loaded once
        self._folder = None  # folder seeds, decoded per index
        if spec == "gaussian" and image_size > GAUSSIAN_MAX_IMAGE_SIZE:
            dims = 3 * image_size * image_size
            raise SeedImageError(
                f"image_log.seed_images: 'gaussian' fits a full {dims} x {dims} covariance at "
                f"data.image_size={image_size} ({dims * dims * 8 / 2**30:.0f} GiB), too large "
                f"above {GAUSSIAN_MAX_IMAGE_SIZE} px; use noise, lowfreq-noise or a seed file")
        if spec not in NOISE_SEEDS:
            self._open(spec)

    def _open(self, path: str) -> None:
        # Imported here: the data module is heavy and only file/folder seeds need it.
        if os.path.isdir(path):
            files = list_image_files(path)
            if not files:
                raise SeedImageError(
                    f"image_log.seed_images: folder '{path}' holds no images; put .png/.jpg "
                    "files in it, or set image_log.seed_images=noise")
            self._folder = SeedFolder(files, self.size)
        elif os.path.isfile(path):
            try:
                images = image_tensor_file(path)
            except ValueError as err:  # DataError: bad shape / dtype / extension
                raise SeedImageError(f"image_log.seed_images: {err}") from None
            if images.shape[0] == 0:
                raise SeedImageError(f"image_log.seed_images: '{path}' holds no images")
            if images.numel() == 0:  # (40, 3, 0, 16): no pixels to resize
                raise SeedImageError(f"image_log.seed_images: '{path}' holds images of shape "
                                     f"{tuple(images.shape[1:])}, with no pixels; save "
                                     "(N, 3, H, W) images with H, W >= 1")
            bad = int((~torch.isfinite(images)).sum())
            if bad:  # the [0, 1] check lets NaN through (every comparison with it is false)
                raise SeedImageError(f"image_log.seed_images: '{path}' holds {bad} NaN or "
                                     "infinite pixel value(s); save finite images in [0, 1]")
            self._tensor = _resize(images, self.size)
        else:
            raise SeedImageError(
                f"image_log.seed_images: '{path}' does not exist; use 'noise', a .pt/.npz "
                "image tensor file or a folder of images")

    def __call__(self, indices: Tensor) -> Tensor:
        """(k, 3, S, S) float seeds for the sample indices (cpu)."""
        seeds = self._unblurred(indices)
        if self.blur_kernel_size <= 1:
            return seeds
        return gaussian_blur(seeds, self.blur_kernel_size).clamp(0.0, 1.0)

    def _unblurred(self, indices: Tensor) -> Tensor:
        idx = np.asarray(indices.cpu(), dtype=np.int64)
        if self._tensor is not None:
            return self._tensor[torch.from_numpy(idx % self._tensor.shape[0])]
        if self._folder is not None:
            return self._folder.images(idx % len(self._folder)).float().div(255.0)
        keys = torch.from_numpy(sample_keys(self.rand_seed, "eval", 0, idx, SEED_PURPOSE))
        if self.spec == "gaussian":
            return self._gaussian(keys)
        # lowfreq-noise: uniform noise at 1/4 resolution, upsampled (smooth, image-like seeds)
        side = max(1, self.size // 4) if self.spec == "lowfreq-noise" else self.size
        noise = keyed_uniform(keys, 3 * side * side).view(-1, 3, side, side)
        if side == self.size:
            return noise
        return F.interpolate(noise, size=(self.size, self.size), mode="bilinear",
                             align_corners=False)


    def _gaussian(self, keys: Tensor) -> Tensor:
        """A normal distribution fitted to the training images (mean and full covariance),
        sampled per key: image-like seeds that carry no class, so the ascent on f_y decides
        which digit/object appears."""
        mean, chol = fitted_gaussian(self.evaluation)
        z = keyed_normal(keys, mean.numel()).double()
        return (mean + z @ chol.T).float().clamp(0, 1).view(-1, 3, self.size, self.size)


def balanced_labels(indices: Tensor, num_classes: int) -> Tensor:
    return indices.to(torch.int64) % num_classes


_NOTICES: set = set()  # sampling notices already logged by this process


def sampling_mode(evaluation: EvaluationSection) -> Tuple[bool, str]:
    """(unconditional, the reason): `eval.unconditional_samples` when set, else
    `logsumexp_sampling` (the original's compute_fid generates with logsumexp=logsumexp_sampling,
    and run_fid_eval.py --unconditional sets it)."""
    explicit = evaluation.eval.unconditional_samples
    if explicit is not None:
        return bool(explicit), f"eval.unconditional_samples={str(bool(explicit)).lower()}"
    if evaluation.method.logsumexp_sampling:
        return True, "logsumexp_sampling=true"
    return False, "class-conditional by default"


def unconditional_samples(evaluation: EvaluationSection) -> bool:
    return sampling_mode(evaluation)[0]


def sampling_notice(evaluation: EvaluationSection) -> Optional[str]:
    """The line that says the samples' kind where logsumexp_sampling decides it (or an explicit
    eval.unconditional_samples overrules it); None otherwise."""
    unconditional, _ = sampling_mode(evaluation)
    if not evaluation.method.logsumexp_sampling:
        return None
    if unconditional and evaluation.eval.unconditional_samples is None:
        return ("samples are unconditional (ascending logsumexp_k f_k) because "
                "logsumexp_sampling=true, as in the original's compute_fid; set "
                "eval.unconditional_samples=false for class-conditional samples")
    if not unconditional:
        return ("samples are class-conditional (eval.unconditional_samples=false) although "
                "logsumexp_sampling=true; the original's would be unconditional")
    return None


class SampleGenerator:
    """Sample i for any index i: seed image i of `seeds` (the SeedImages of `evaluation`), label
    i % num_classes, and `num_steps` PGD steps ascending f_y (conditional) or logsumexp_k f_k
    (unconditional, `sampling_mode`)."""

    def __init__(self, model: nn.Module, evaluation: EvaluationSection, runtime: Runtime,
                 seeds: "SeedImages", num_steps: Optional[int] = None):
        self.model = unwrap(model)  # defensive: never a rank-local forward through DDP
        self.evaluation, self.runtime = evaluation, runtime
        log = evaluation.image_log
        self.num_steps = log.num_steps if num_steps is None else num_steps
        self.objective = "lse" if unconditional_samples(evaluation) else "logit"
        notice = sampling_notice(evaluation)
        if notice and runtime.is_main and notice not in _NOTICES:
            _NOTICES.add(notice)
            LOGGER.info(notice)
        self.seeds = seeds

    def __call__(self, indices: Tensor) -> SampleChunk:
        """The samples of `indices` (cpu int64) as a SampleChunk; the model must be in eval mode."""
        log, device = self.evaluation.image_log, self.runtime.device
        x = self.seeds(indices).to(device)
        labels = balanced_labels(indices, self.evaluation.data.num_classes)
        images = pgd_attack(self.model, x, steps=self.num_steps, step_size=log.step_size,
                            eps=log.eps, norm=log.norm, objective=self.objective,
                            y=labels.to(device))
        return SampleChunk(indices, labels, images.detach(), x, self.evaluation.eval.sample_pixels)


# The grids of the original's compute_fid (rebm/eval/eval_utils.py:434-551 at fb2ffc7): a row per
# class of its first 10 samples (max_samples_per_class, also make_grid's nrow), padding 1.
GRID_PER_CLASS = 10
GRID_KINDS = ("gen", "seed")  # the samples, and the seeds they started from


def grid_indices(num_samples: int, num_classes: int, limit: int) -> List[int]:
    """The sample indices the grids show, in grid order: class by class, the first
    GRID_PER_CLASS samples of each (indices c, c + C, c + 2C, ... below num_samples), for the
    first ceil(limit / GRID_PER_CLASS) classes and at most `limit` images. limit 100 gives the
    original's min(10, C) classes (eval_utils.py:435-437); it shows fewer samples of a class
    only when num_samples runs out, and then its rows no longer start with a class."""
    classes = min(num_classes, -(-limit // GRID_PER_CLASS))
    order = [c + k * num_classes for c in range(classes) for k in range(GRID_PER_CLASS)
             if c + k * num_classes < num_samples]
    return order[:limit]





def grid_pixels(images: Tensor, low: float, high: float) -> Tensor:
    """uint8 images as the original's grid PNG holds them: make_grid's normalize=True with the
    grid's minimum `low` and maximum `high` (clamp, subtract, divide, in float32 on the cpu as
    there), then to_pil_image's floor(255 x). Element-wise, so any rank may quantise its own."""
    x = images.detach().float().cpu().clamp(low, high).sub(low).div(max(high - low, 1e-5))
    return x.mul(255).to(torch.uint8)


def save_grid(pixels: Tensor, path: str) -> str:
    """uint8 images in grid order as one PNG, GRID_PER_CLASS a row with 1 black pixel between
    them (make_grid's layout; rank 0 only calls this)."""
    grid = Image.fromarray(make_grid(pixels.cpu(), nrow=GRID_PER_CLASS, padding=1)
                           .permute(1, 2, 0).numpy())
    return write_replacing(path, lambda tmp: grid.save(tmp, format="PNG"))
