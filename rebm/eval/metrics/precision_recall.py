"""Precision and recall of the generated samples against real images (registered metric
"precision_recall"; Kynkäänniemi et al. 2019), through torch-fidelity.

The real images (the reference) are, by `eval.pr_reference`:
- an .npz in OpenAI's format (`arr_0`: uint8 N x H x W x 3, e.g. guided-diffusion's
  VIRTUAL_imagenet256_labeled.npz, the reference batch the original's README evaluates against),
  all its rows, or the first `eval.pr_num_real`; an uncompressed npz (as np.savez writes it) is
  memory-mapped, so each rank reads only its own rows;
- otherwise a seeded random subset of the in-distribution split `eval.pr_reference_split`,
  balanced over the classes (`reference_indices`: the same count per class, the remainder to the
  lowest labels; seeded by rand_seed, so the same on any world size), of `eval.pr_num_real`
  images (default: as many as samples), at data.image_size without augmentation, in 8 bits
  (`eval.sample_pixels`; 8-bit images are unchanged by it).

Their features and the samples' (torch-fidelity's Inception pool 2048-d, or the stand-in's) are
kept as rows and gathered on every rank; every rank then computes the k-NN radii and the member
counts of its share of the rows (rebm/eval/features/knn.py): the numbers of torch-fidelity's
`calculate_precision_recall_part` with its default neighbourhood k = 3, bitwise, in working
memory that does not grow with the number of rows. Precision: the fraction of samples inside the
real images' k-NN balls; recall: the fraction of real images inside the samples' balls. Stored
as "precision", "recall" and "n_real". The original computed these with OpenAI's TensorFlow
evaluator on the same reference batch; rebm uses torch-fidelity's Inception features instead,
so its numbers are comparable with torch-fidelity's, not with that evaluator's.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from rebm.config.datasets import indist_root_files
from rebm.config.views import EvaluationSection
from rebm.data.indexing import eval_chunks
from rebm.data.pipeline import load_indist
from rebm.distributed.logs import progress
from rebm.distributed.signals import stop_points_all_ranks
from rebm.eval.features.fid import weights_files
from rebm.eval.features.fidelity import (
    FeatureRows,
    chunk_features,
    extract,
    feature_layer,
    fidelity_network_name,
    library_version,
    shared_extractor,
    text_order,
)
from rebm.eval.features.knn import precision_recall_all_ranks
from rebm.eval.features.network import network_key, network_problems, shown_as
from rebm.eval.metric import SAMPLES, EvalContext, EvalError, Metric, SampleChunk, to_pixels
from rebm.eval.sampling.samples import describe_samples, sample_files, sample_settings

NEIGHBORHOOD = 3  # torch-fidelity's default prc_neighborhood
REFERENCE_SALT = 0x5052  # keeps the reference's draw apart from other uses of rand_seed
NPZ_KEY = "arr_0"


# --------------------------------------------------------------------------------------------
# The reference: a class-balanced random subset of a split, or an OpenAI reference batch
# --------------------------------------------------------------------------------------------
def reference_indices(labels: np.ndarray, n: int, seed: int) -> np.ndarray:
    """`n` indices (ascending) of a split whose images have `labels`: a random subset drawn with
    `seed`, balanced over the classes. Every class gives floor(n / C) images and the lowest
    labels one more for the remainder; a class with too few images gives all it has and the
    others fill in, round-robin by label. Images are drawn in a seeded random order within each
    class (round r takes each class's r-th image), so the subset never depends on the split's
    order or on the world size."""
    labels = np.asarray(labels)
    n = min(int(n), len(labels))
    order = np.random.default_rng([int(seed), REFERENCE_SALT]).permutation(len(labels))
    _, cls = np.unique(labels[order], return_inverse=True)  # class rank of each drawn image
    by_class = np.argsort(cls, kind="stable")  # grouped by class, in draw order inside a class
    grouped = cls[by_class]
    rank = np.empty(len(order), dtype=np.int64)  # position of each image within its class
    rank[by_class] = np.arange(len(order)) - np.searchsorted(grouped, grouped, side="left")
    pick = np.lexsort((cls, rank))[:n]  # round-robin: by rank, then by class
    return np.sort(order[pick])


def _npy_header(path: str, key: str) -> Tuple[tuple, np.dtype, bool, Optional[int]]:
    """(shape, dtype, fortran order, byte offset of the data or None when compressed) of the
    `key` array of an .npz, read from its zip headers only."""
    with zipfile.ZipFile(path) as archive:
        member = f"{key}.npy"
        if member not in archive.namelist():
            keys = sorted(name[:-4] for name in archive.namelist() if name.endswith(".npy"))
            raise EvalError(f"eval.pr_reference '{path}' has no '{key}' array (it has "
                            f"{', '.join(keys) or 'none'}); use a reference batch in OpenAI's "
                            "format (arr_0: uint8 N x H x W x 3)")
        info = archive.getinfo(member)
        with archive.open(member) as fh:
            version = np.lib.format.read_magic(fh)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read(fh)
            header_bytes = fh.tell()
    if info.compress_type != zipfile.ZIP_STORED:
        return shape, dtype, fortran, None
    with open(path, "rb") as fh:  # the local header's name and extra fields precede the data
        fh.seek(info.header_offset)
        name_len, extra_len = struct.unpack("<HH", fh.read(30)[26:30])
    return shape, dtype, fortran, info.header_offset + 30 + name_len + extra_len + header_bytes


def check_reference_batch(path: str, image_size: int) -> Tuple[tuple, Optional[int]]:
    """(shape, data offset) of the reference batch at `path`; EvalError, one line, when it is
    missing, not an .npz, or not uint8 N x S x S x 3 with S = data.image_size."""
    if not os.path.isfile(path):
        raise EvalError(f"eval.pr_reference '{path}' does not exist; point it at a reference "
                        "batch .npz (arr_0: uint8 N x H x W x 3), or unset it to use a "
                        "class-balanced subset of eval.pr_reference_split")
    try:
        shape, dtype, fortran, offset = _npy_header(path, NPZ_KEY)
    except (zipfile.BadZipFile, ValueError, OSError) as err:
        raise EvalError(f"eval.pr_reference '{path}' is not a readable .npz "
                        f"({type(err).__name__}: {err})") from None
    if dtype != np.uint8 or len(shape) != 4 or shape[3] != 3 or fortran:
        raise EvalError(f"eval.pr_reference '{path}': arr_0 is {dtype} {'x'.join(map(str, shape))}"
                        "; a reference batch is uint8 N x H x W x 3 (OpenAI's format)")
    if shape[1:3] != (image_size, image_size):
        raise EvalError(f"eval.pr_reference '{path}' holds {shape[1]} x {shape[2]} images but the "
                        f"samples are {image_size} x {image_size} (data.image_size); use a "
                        f"reference batch of {image_size} px images")
    if shape[0] == 0:
        raise EvalError(f"eval.pr_reference '{path}' holds no images")
    return shape, offset


def open_reference_batch(path: str, image_size: int) -> np.ndarray:
    """The arr_0 rows of a reference batch (N, S, S, 3) uint8: memory-mapped when stored
    uncompressed, else read whole."""
    shape, offset = check_reference_batch(path, image_size)
    if offset is not None:
        return np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=shape)
    with np.load(path) as archive:
        return archive[NPZ_KEY]


def num_real(evaluation: EvaluationSection, available: int) -> int:
    """Real images of the reference: eval.pr_num_real, else all rows of a reference batch or as
    many as samples from a split; at most `available`."""
    if evaluation.eval.pr_num_real:
        return min(evaluation.eval.pr_num_real, available)
    if evaluation.eval.pr_reference:
        return available
    return min(evaluation.image_log.num_samples, available)


class _Reference:
    """The reference images by position 0..n-1, as uint8 NCHW."""

    def __init__(self, evaluation: EvaluationSection):
        self.pixels = evaluation.eval.sample_pixels
        if evaluation.eval.pr_reference:
            self.batch = open_reference_batch(evaluation.eval.pr_reference,
                                              evaluation.data.image_size)
            self.n = num_real(evaluation, self.batch.shape[0])
            return
        split = evaluation.eval.pr_reference_split
        self.batch = None
        self.dataset = load_indist(evaluation.data, split, "test")
        labels = self.dataset.source.labels(np.arange(len(self.dataset))).numpy()
        self.indices = reference_indices(labels, num_real(evaluation, len(labels)),
                                         evaluation.schedule.rand_seed)
        self.n = len(self.indices)

    def images(self, positions: range) -> torch.Tensor:
        if self.batch is not None:
            rows = np.array(self.batch[positions.start:positions.stop])  # a copy, writable
            return torch.from_numpy(rows).permute(0, 3, 1, 2)
        images = torch.stack([self.dataset[int(self.indices[p])][0] for p in positions])
        return to_pixels(images, self.pixels)


def real_features_all_ranks(ctx: EvalContext, extractor, layer: str) -> torch.Tensor:
    """Features of the reference images (position order), on every rank: chunk k on rank
    k % W."""
    rt = ctx.runtime
    reference = _Reference(ctx.evaluation)
    rows = FeatureRows()
    chunks = eval_chunks(reference.n, ctx.batch_size, rt.rank, rt.world_size)
    stops = stop_points_all_ranks(rt, len(chunks))
    for index, chunk in enumerate(progress(chunks, rt, "real features", total=len(chunks))):
        stops.check_all_ranks(index)
        features = extract(extractor, reference.images(chunk).to(rt.device))[layer]
        rows.add(torch.arange(chunk.start, chunk.stop), features)
    return rows.gather_all_ranks(rt, reference.n)


# --------------------------------------------------------------------------------------------
# The metric
# --------------------------------------------------------------------------------------------
class PrecisionRecall(Metric):
    name = "precision_recall"
    summary = (("precision", "precision", "{:.3f}"), ("recall", "recall", "{:.3f}"))
    source = SAMPLES
    # 2: the reference (an OpenAI batch, or a seeded class-balanced subset, never the first N),
    # eval.sample_pixels, unblurred seeds, logsumexp_sampling -> unconditional
    protocol = 2

    @classmethod
    def settings(cls, evaluation: EvaluationSection) -> Dict[str, Any]:
        ev = evaluation.eval
        if ev.pr_reference:
            reference = {"reference": "npz", "reference_batch": ev.pr_reference}
        else:
            reference = {"reference": "class-balanced random subset",
                         "reference_dataset": evaluation.data.indist_dataset,
                         "reference_split": ev.pr_reference_split,
                         "reference_seed": evaluation.schedule.rand_seed}
        return {"library": library_version(), "neighborhood": NEIGHBORHOOD,
                "features": fidelity_network_name(evaluation.image_log), "quantized": "8 bit",
                **reference,
                "num_real": ev.pr_num_real or ("all" if ev.pr_reference else "as many as samples"),
                **sample_settings(evaluation)}

    @classmethod
    def files(cls, evaluation: EvaluationSection) -> Dict[str, Optional[str]]:
        ev = evaluation.eval
        reference = ({"eval.pr_reference": ev.pr_reference} if ev.pr_reference
                     else indist_root_files(evaluation.data))
        return {**reference, **sample_files(evaluation),
                **weights_files(evaluation.image_log)}

    @classmethod
    def problems(cls, evaluation: EvaluationSection) -> List[str]:
        problems = network_problems(evaluation.image_log)
        if evaluation.eval.pr_reference:
            try:
                check_reference_batch(evaluation.eval.pr_reference, evaluation.data.image_size)
            except EvalError as err:
                problems.append(str(err))
        return problems

    @classmethod
    def build(cls, evaluation: EvaluationSection, runtime, resources: Dict[str, Any]) -> None:
        shared_extractor(evaluation, runtime, resources)  # the network, loaded once

    def __init__(self, ctx: EvalContext):
        super().__init__(ctx)
        self.extractor = shared_extractor(ctx.evaluation, ctx.runtime, ctx.resources)
        self.layer = feature_layer(self.extractor, "prc")
        self.real: Optional[torch.Tensor] = None
        self.rows = FeatureRows()

    def start_all_ranks(self) -> None:
        """The real images' features: computed at the run's first evaluation, then kept."""
        evaluation = self.ctx.evaluation
        key = json.dumps(["precision_recall real features", self.settings(evaluation),
                          evaluation.image_log.inception_weights], sort_keys=True, default=str)
        self.real = self.ctx.shared(key, lambda: real_features_all_ranks(
            self.ctx, self.extractor, self.layer))

    def update(self, chunk: SampleChunk) -> None:
        self.rows.add(chunk.indices, chunk_features(chunk, self.extractor)[self.layer])

    def finish_all_ranks(self) -> Dict[str, Any]:
        total, n_real = self.ctx.evaluation.image_log.num_samples, int(self.real.shape[0])
        if min(total, n_real) <= NEIGHBORHOOD:
            raise EvalError(f"precision/recall needs more than k = {NEIGHBORHOOD} samples and real "
                            f"images (got {total} and {n_real}); raise image_log.num_samples or "
                            "eval.pr_num_real")
        generated = self.rows.gather_all_ranks(self.ctx.runtime, total)[text_order(total)]
        precision, recall = precision_recall_all_ranks(self.ctx.runtime, generated, self.real,
                                                       NEIGHBORHOOD)
        log = self.ctx.evaluation.image_log
        return {network_key(log, "precision"): precision, network_key(log, "recall"): recall,
                "n_real": n_real}

    @classmethod
    def describe(cls, results, settings) -> List[Tuple[str, str, str]]:
        precision, mark = shown_as(settings["features"], "precision")
        recall, _ = shown_as(settings["features"], "recall")
        note = f", {mark}" if mark else ""
        if settings["reference"] == "npz":
            against = os.path.basename(settings["reference_batch"])
        else:
            against = (f"{settings['reference_split']} images (class-balanced, seed "
                       f"{settings['reference_seed']})")
        where = (f"k = {settings['neighborhood']}, vs {results.get('n_real')} {against}; "
                 f"{settings['features']}; " + describe_samples(settings))
        return [(f"precision{note}", f"{results[precision]:.4f}", where),
                (f"recall{note}", f"{results[recall]:.4f}", where)]
