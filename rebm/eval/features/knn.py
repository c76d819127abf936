"""Precision and recall's k-NN computation (Kynkäänniemi et al. 2019), sharded over the ranks
(rebm/eval/metrics/precision_recall.py).

The numbers are torch-fidelity's `calculate_precision_recall_part` (its `save_cpu_ram` path, the
library's defaults k = 3 and batch 10000) on the same feature rows, computed on every rank for
its share of the rows:

- A set's k-NN radius of row i is the (k+1)-th smallest entry of row i of the set's distance
  matrix (itself included, at distance ~0), as the library's `kthvalue(k + 1)`: kept as the
  running k+1 smallest over column blocks, whose largest is that value (ties do not matter: a
  value is a value).
- A row is a member when its distance to some row of the other set is <= that row's radius
  (the library's `<=` and `any`).
- Rank r takes the rows [r N / W, (r+1) N / W) of each set (by row position, so which rank
  computes a row never changes its numbers); the radii are all-gathered (N floats), the two
  member counts summed (one all-reduce), and the fractions are the library's float32 means.

Distances are torch.cdist's, on the CPU like the library's, and bitwise the library's: each
block of rows and columns lies inside one of the library's 10000-row batches, `compute_mode`
is the choice torch.cdist makes for the library's batch shapes (the matrix product when either
side has more than 25 rows), and a block is at least MIN_ROWS rows and columns (widened inside
its batch, the extra distances dropped), or, beside a batch shorter than that, exactly the
library's call. MKL's GEMM gives an entry the same bits in any product of such sizes, but not in
products with a few rows or columns (gemv and small-size paths); tests/test_fidelity_sharded.py
checks the radii and counts against the library's on 1 to 16 threads.

Working memory per rank is bounded by the blocks (ROW_BLOCK x COL_BLOCK distances and
torch.cdist's padded copies of the two blocks), whatever N: no N x N matrix.
"""

from __future__ import annotations

from typing import Iterator, List, Tuple

import torch
from torch import Tensor

from rebm.distributed import Runtime, all_reduce_sum
from rebm.distributed.collectives import all_gather_by_index, on_every_rank

LIBRARY_BATCH = 10000  # torch-fidelity's default prc_batch_size: the shapes of its cdist calls
ROW_BLOCK = 1024  # rows of one distance block
COL_BLOCK = 4096  # columns of one distance block
# MKL's GEMM rounds products with few rows or columns differently (gemv and small-size paths,
# and each thread's piece of a product): with MKL 2024.2 on 1 to 16 threads, blocks of 256 and
# more gave the library's bits, blocks of 100 did not on 4 threads
MIN_ROWS = 256
MM_ABOVE = 25  # torch.cdist multiplies matrices when either side has more rows than this


def row_share(n: int, rank: int, world_size: int) -> range:
    """The rows [rank N / W, (rank+1) N / W) of a set of n rows: this rank's share."""
    return range(rank * n // world_size, (rank + 1) * n // world_size)


def blocks(span: range, n: int, size: int) -> Iterator[Tuple[range, range]]:
    """(rows kept, the library batch holding them) covering `span` of a set of n rows: pieces of
    at most `size` rows that never cross one of the library's batches."""
    for batch_start in range(0, n, LIBRARY_BATCH):
        batch = range(batch_start, min(batch_start + LIBRARY_BATCH, n))
        lo, hi = max(span.start, batch.start), min(span.stop, batch.stop)
        for start in range(lo, hi, size):
            yield range(start, min(start + size, hi)), batch


def _widened(kept: range, batch: range) -> range:
    """At least MIN_ROWS rows of `batch` around `kept` (the whole batch when shorter)."""
    first = max(batch.start, min(kept.start, batch.stop - MIN_ROWS))
    return range(first, max(kept.stop, min(first + MIN_ROWS, batch.stop)))


def _distances(rows: Tensor, row_block: Tuple[range, range], cols: Tensor,
               col_block: Tuple[range, range]) -> Tensor:
    """Distances of the kept rows to the kept columns, with the arithmetic of the library's
    torch.cdist call on the batches that hold them: blocks of at least MIN_ROWS on both sides,
    or, next to a batch shorter than that, the library's very call (its two whole batches)."""
    (r_kept, r_batch), (c_kept, c_batch) = row_block, col_block
    if min(len(r_batch), len(c_batch)) < MIN_ROWS:
        r_computed, c_computed = r_batch, c_batch
    else:
        r_computed, c_computed = _widened(r_kept, r_batch), _widened(c_kept, c_batch)
    mode = ("use_mm_for_euclid_dist" if max(len(r_batch), len(c_batch)) > MM_ABOVE
            else "donot_use_mm_for_euclid_dist")
    out = torch.cdist(rows[r_computed.start:r_computed.stop],
                      cols[c_computed.start:c_computed.stop], compute_mode=mode)
    r0, c0 = r_kept.start - r_computed.start, c_kept.start - c_computed.start
    return out[r0:r0 + len(r_kept), c0:c0 + len(c_kept)]


def knn_radii(features: Tensor, share: range, k: int) -> Tensor:
    """The k-NN radii (distance to the k-th neighbour, the row itself counted as its 0-th) of
    the rows `share` of `features`, against all its rows; the set needs more than k rows."""
    n = features.shape[0]
    radii = torch.empty(len(share), dtype=features.dtype)
    columns: List[Tuple[range, range]] = list(blocks(range(n), n, COL_BLOCK))
    for row_block in blocks(share, n, ROW_BLOCK):
        nearest = None  # the k+1 smallest distances so far, per row
        for col_block in columns:
            dist = _distances(features, row_block, features, col_block)
            if nearest is not None:
                dist = torch.cat([nearest, dist], dim=1)
            nearest = dist.topk(min(k + 1, dist.shape[1]), dim=1, largest=False).values
        kept = row_block[0]
        radii[kept.start - share.start:kept.stop - share.start] = nearest.max(dim=1).values
    return radii


def count_inside(points: Tensor, share: range, centres: Tensor, radii: Tensor) -> int:
    """How many of the rows `share` of `points` lie inside some centre's ball (distance <= its
    radius)."""
    n, m = points.shape[0], centres.shape[0]
    columns = list(blocks(range(m), m, COL_BLOCK))
    count = 0
    for row_block in blocks(share, n, ROW_BLOCK):
        inside = torch.zeros(len(row_block[0]), dtype=torch.bool)
        for col_block in columns:
            kept = col_block[0]
            dist = _distances(points, row_block, centres, col_block)
            inside |= (dist <= radii[kept.start:kept.stop]).any(dim=1)
            if bool(inside.all()):  # the rest cannot change the count
                break
        count += int(inside.sum())
    return count


def library_fraction(count: int, n: int) -> float:
    """count / n as the library reports it: the float32 mean of n 0/1 flags."""
    return torch.cat([torch.ones(count), torch.zeros(n - count)]).mean().item()


def precision_recall_all_ranks(runtime: Runtime, generated: Tensor, real: Tensor,
                               k: int) -> Tuple[float, float]:
    """(precision, recall) of the generated rows against the real rows (both on every rank, on
    the CPU), each rank computing its share. Every rank must call this."""
    n_gen, n_real = generated.shape[0], real.shape[0]
    gen_share = row_share(n_gen, runtime.rank, runtime.world_size)
    real_share = row_share(n_real, runtime.rank, runtime.world_size)

    def my_radii() -> Tensor:
        return torch.cat([knn_radii(generated, gen_share, k), knn_radii(real, real_share, k)])

    mine = on_every_rank(runtime, my_radii, "compute its share of the k-NN radii")
    positions = torch.cat([torch.arange(gen_share.start, gen_share.stop),
                           n_gen + torch.arange(real_share.start, real_share.stop)])
    device = runtime.device
    radii = all_gather_by_index(runtime, mine.to(device), positions.to(device),
                                n_gen + n_real).cpu()

    def my_counts() -> Tensor:
        return torch.tensor([count_inside(generated, gen_share, real, radii[n_gen:]),
                             count_inside(real, real_share, generated, radii[:n_gen])])

    counts = on_every_rank(runtime, my_counts, "count its share of precision/recall members")
    precision, recall = all_reduce_sum(runtime, counts.to(device)).cpu().tolist()
    return library_fraction(precision, n_gen), library_fraction(recall, n_real)
