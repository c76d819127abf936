"""What the evaluation's passes over images share: the model in eval mode for a pass, and the
loader of this rank's chunks of positions (the test set's, the OOD sets', the counterfactuals'),
the same batches on any world size."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from rebm.data.indexing import eval_chunks
from rebm.distributed import Runtime


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Eval mode for the duration, then the caller's mode back (the training loop evaluates
    mid-run and must get its train-mode model back)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


class _Chunks(Dataset):
    """Item j = (images, positions) of this rank's j-th chunk; `read(positions)` gives the
    float [0, 1] images of those positions."""

    def __init__(self, read: Callable[[np.ndarray], Tensor], chunks: List[range]):
        self.read = read
        self.chunks = chunks

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, j: int):
        positions = np.arange(self.chunks[j].start, self.chunks[j].stop, dtype=np.int64)
        return self.read(positions), torch.from_numpy(positions)


def chunk_loader(read: Callable[[np.ndarray], Tensor], n: int, batch_size: int,
                 runtime: Runtime, num_workers: int = 0) -> DataLoader:
    """This rank's chunks [k·B, (k+1)·B) of positions [0, n), k ≡ rank (mod W): the same
    batches on any world size (rebm.data.indexing.eval_chunks)."""
    chunks = eval_chunks(n, batch_size, runtime.rank, runtime.world_size)
    return DataLoader(_Chunks(read, chunks), batch_size=None, num_workers=num_workers,
                      persistent_workers=False)
