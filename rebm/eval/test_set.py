"""The test images an evaluation uses, and the one pass over them that every test-set metric shares.

The images are the in-distribution test split, or the subset `eval.image_ids` names (one id a
line: a 0-based index, or a path relative to the split folder such as RobustBench's
`n01440764/ILSVRC2012_val_00000293.JPEG`; `robustbench` names the shipped list of the 5000
ImageNet validation images RobustBench uses, rebm/eval/data/), cut to the first
`eval.num_images`. They are split
into chunks of one evaluation batch, chunk k on rank k % W (`rebm.data.indexing.eval_chunks`): a
batch holds the same images on any world size, so per-batch attacks (AutoAttack draws its random
numbers per batch) give the same results on 1, 2 or 3 ranks.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from rebm.config.datasets import indist_root_files
from rebm.config.views import EvaluationSection
from rebm.data.indexing import eval_chunks
from rebm.data.pipeline import build_eval_data, indist_source
from rebm.distributed import Runtime, all_reduce_sum
from rebm.distributed.logs import progress
from rebm.distributed.signals import stop_points_all_ranks
from rebm.eval.metric import EvalError, Metric, TestBatch

ROBUSTBENCH_IDS = os.path.join(os.path.dirname(__file__), "data",
                               "imagenet_val_5000_robustbench.txt")


def test_set_settings(evaluation: EvaluationSection) -> Dict[str, Any]:
    """Which test images a test-set metric ran on (part of every such metric's settings)."""
    return {"dataset": evaluation.data.indist_dataset, "split": "test",
            "image_ids": evaluation.eval.image_ids, "num_images": evaluation.eval.num_images}


def test_set_files(evaluation: EvaluationSection) -> Dict[str, Optional[str]]:
    """The dataset root and the ids file a test-set metric reads (`Metric.files`)."""
    files: Dict[str, Optional[str]] = indist_root_files(evaluation.data)
    if evaluation.eval.image_ids:
        files["eval.image_ids"] = (ROBUSTBENCH_IDS if evaluation.eval.image_ids == "robustbench"
                                   else evaluation.eval.image_ids)
    return files


def describe_test_set(settings: Dict[str, Any], n_test: Any) -> str:
    """'100 test images', '1000 test images (first 1000 of ids.txt)'."""
    text = f"{n_test} test images" if n_test is not None else "test images"
    parts = []
    if settings.get("num_images"):
        parts.append(f"first {settings['num_images']}")
    if settings.get("image_ids"):
        parts.append(f"{'of' if parts else 'ids from'} {os.path.basename(settings['image_ids'])}")
    return text + (f" ({' '.join(parts)})" if parts else "")


def _relative_paths(source, evaluation: EvaluationSection, path: str, ids: List[str]) -> List[str]:
    files = getattr(source, "files", None)
    if files is None:  # a split held in memory (digits): its images are known by index only
        word = next(i for i in ids if not i.isdigit())
        raise EvalError(f"eval.image_ids '{path}': '{word}' is not a 0-based index, and the "
                        f"test split of {evaluation.data.indist_dataset} has no files to name "
                        "by path; "
                        "write one 0-based index a line")
    root = getattr(files, "root", os.path.join(evaluation.data.indist_ds_dir, "test"))
    return [os.path.normpath(os.path.relpath(files[i], root)) for i in range(len(files))]


def read_image_ids(path: str, source, evaluation: EvaluationSection) -> np.ndarray:
    """Dataset indices of the ids in the file `path` (indices or relative paths), in file order."""
    try:
        with open(path) as fh:
            ids = [line.strip() for line in fh if line.strip() and not line.startswith("#")]
    except OSError as err:
        raise EvalError(f"eval.image_ids '{path}' cannot be read ({err.strerror or err}); point "
                        "it at a text file with one test image id a line") from None
    if not ids:
        raise EvalError(f"eval.image_ids '{path}' holds no ids")
    if all(i.isdigit() for i in ids):
        indices = np.array([int(i) for i in ids], dtype=np.int64)
        bad = indices[indices >= len(source)]
        if len(bad):
            raise EvalError(f"eval.image_ids '{path}': index {int(bad[0])} is out of range: the "
                            f"test split has {len(source)} images")
        return indices
    where = {rel: i for i, rel in enumerate(_relative_paths(source, evaluation, path, ids))}
    missing = [i for i in ids if os.path.normpath(i) not in where]
    if missing:
        raise EvalError(f"eval.image_ids '{path}': {len(missing)} of {len(ids)} ids are not in "
                        f"the test split (first: '{missing[0]}'); ids are 0-based indices or "
                        "paths relative to the split folder")
    return np.array([where[os.path.normpath(i)] for i in ids], dtype=np.int64)


def test_indices(evaluation: EvaluationSection, source=None) -> Sequence[int]:
    """The dataset indices of the evaluation's test images, in order (`source`: the test split's
    images, if loaded already)."""
    source = source if source is not None else indist_source(evaluation.data, "test")
    if evaluation.eval.image_ids:
        ids = evaluation.eval.image_ids
        path = ROBUSTBENCH_IDS if ids == "robustbench" else ids
        indices: Sequence[int] = read_image_ids(path, source, evaluation)
    else:
        indices = range(len(source))
    return indices[:evaluation.eval.num_images] if evaluation.eval.num_images else indices


class TestData:
    """This rank's test images, built once per Evaluator and config: the indices of
    `test_indices` (`n_images` of them), this rank's chunks of positions in that list, and their
    loader (every chunk but the last one overall is full, so the loader's batches are the
    chunks)."""

    def __init__(self, evaluation: EvaluationSection, runtime: Runtime, batch_size: int):
        source = indist_source(evaluation.data, "test")  # loaded once, for the ids and the loader
        indices = test_indices(evaluation, source)
        self.n_images = len(indices)
        self.chunks = eval_chunks(self.n_images, batch_size, runtime.rank, runtime.world_size)
        mine = [int(indices[p]) for chunk in self.chunks for p in chunk]
        self.loader = build_eval_data(evaluation.data, runtime, batch_size, indices=mine, source=source)


def run_test_pass_all_ranks(data: TestData, model, runtime: Runtime, metrics: List[Metric]
                            ) -> Tuple[int, List[Dict[str, Any]]]:
    """Feed every batch of this rank's test chunks to every metric, then finish them: (images
    evaluated over all ranks, each metric's results). Stops at a stop point when a stop is
    asked for (rebm.distributed.signals). Every rank calls this."""
    loader = data.loader
    stops = stop_points_all_ranks(runtime, len(loader))
    count = 0
    for index, (x, y, dataset_index) in enumerate(progress(loader, runtime, "evaluation",
                                                           total=len(loader))):
        stops.check_all_ranks(index)
        chunk = data.chunks[index]
        batch = TestBatch(model, x.to(runtime.device, non_blocking=True),
                          y.to(runtime.device, non_blocking=True), dataset_index,
                          torch.arange(chunk.start, chunk.stop), data.n_images)
        for metric in metrics:
            metric.update(batch)
        count += int(y.shape[0])
    n_test = int(all_reduce_sum(runtime, torch.tensor([count], dtype=torch.int64))[0])
    return n_test, [metric.finish_all_ranks() for metric in metrics]
