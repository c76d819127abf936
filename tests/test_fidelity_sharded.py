"""Precision/recall and the Inception Score computed in shares over the ranks
(rebm/eval/features/knn.py, rebm/eval/metrics/inception_score.py) against torch-fidelity's own
functions on the same features: the k-NN radii bitwise, precision and recall equal, IS equal up
to float64 round-off; the same numbers on 1, 2 and 3 real processes (gloo); working memory that
does not grow with the number of rows."""

from __future__ import annotations

import os
import resource

import numpy as np
import pytest
import torch
from torch_fidelity.metric_isc import isc_features_to_metric
from torch_fidelity.metric_prc import calc_cdist_part, calculate_precision_recall_part

from rebm import distributed as rd
from rebm.distributed import Runtime
from rebm.eval.features import knn
from rebm.eval.features.fidelity import text_order
from rebm.eval.metrics.inception_score import (
    SHUFFLE_SEED,
    SplitStatistics,
    fidelity_split_of,
    pil_split_of,
)
from tests.processes import spawn_ranks

K = 3


# one torch thread in this process: the pytest workers already fill the cores
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.numbers]


def _features(n_gen: int, n_real: int, dims: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    generated = torch.randn(n_gen, dims, generator=generator)
    real = torch.randn(n_real, dims, generator=generator) * 1.05 + 0.02
    return generated, real


def _library_radii(features: torch.Tensor, batch: int) -> torch.Tensor:
    """The radii inside torch-fidelity's calculate_precision_recall_part, as it computes them."""
    return torch.cat([calc_cdist_part(rows, features, batch).kthvalue(K + 1).values
                      for rows in features.split(batch)])


def _in_shares(generated, real, world: int):
    """What the ranks of a `world`-rank run compute, one share after the other."""
    n_gen, n_real = len(generated), len(real)
    gen_radii = torch.cat([knn.knn_radii(generated, knn.row_share(n_gen, r, world), K)
                           for r in range(world)])
    real_radii = torch.cat([knn.knn_radii(real, knn.row_share(n_real, r, world), K)
                            for r in range(world)])
    precision = sum(knn.count_inside(generated, knn.row_share(n_gen, r, world), real, real_radii)
                    for r in range(world))
    recall = sum(knn.count_inside(real, knn.row_share(n_real, r, world), generated, gen_radii)
                 for r in range(world))
    return (knn.library_fraction(precision, n_gen), knn.library_fraction(recall, n_real),
            gen_radii, real_radii)


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("n_gen,n_real,dims", [(13, 20, 5), (300, 40, 64), (1210, 1100, 32)])
def test_radii_and_counts_are_the_librarys_on_any_share(monkeypatch, threads, n_gen, n_real,
                                                        dims):
    """Library batches of 600 rows (the default is 10000) put batch edges, a 10-row batch and
    blocks cut by the shares inside these small sets."""
    monkeypatch.setattr(knn, "LIBRARY_BATCH", 600)
    torch.set_num_threads(threads)
    generated, real = _features(n_gen, n_real, dims)
    library = calculate_precision_recall_part(generated, real, K, 600)
    gen_radii, real_radii = _library_radii(generated, 600), _library_radii(real, 600)
    assert 0 < library[0] < 1 and 0 < library[1] < 1  # counts that can go wrong
    for world in (1, 2, 3, 7):
        precision, recall, gen_mine, real_mine = _in_shares(generated, real, world)
        assert (precision, recall) == library, world
        assert torch.equal(gen_mine, gen_radii) and torch.equal(real_mine, real_radii), world


def test_default_blocks_on_2048_d_features_are_the_librarys():
    generated, real = _features(1500, 1400, 2048, seed=1)
    library = calculate_precision_recall_part(generated, real, K, 10000)
    for world in (1, 2, 3):
        assert _in_shares(generated, real, world)[:2] == library, world


def test_blocks_never_cross_a_library_batch_and_cover_the_share(monkeypatch):
    monkeypatch.setattr(knn, "LIBRARY_BATCH", 600)
    share = range(450, 1210)
    pieces = list(knn.blocks(share, 1210, 256))
    kept = [i for piece, _ in pieces for i in piece]
    assert kept == list(share)
    for piece, batch in pieces:
        assert piece.start >= batch.start and piece.stop <= batch.stop
    assert knn._widened(range(1205, 1210), range(1200, 1210)) == range(1200, 1210)
    assert len(knn._widened(range(595, 600), range(0, 600))) == knn.MIN_ROWS


# --------------------------------------------------------------------------------------------
# Inception Score
# --------------------------------------------------------------------------------------------
def _torchmetrics_is(logits: torch.Tensor, seed: int):
    """torchmetrics' InceptionScore.compute with its permutation from a seeded generator."""
    permutation = torch.randperm(len(logits), generator=torch.Generator().manual_seed(seed))
    features = logits[permutation]
    prob, log_prob = features.softmax(dim=1), features.log_softmax(dim=1)
    scores = torch.stack([(p * (lp - p.mean(dim=0, keepdim=True).log())).sum(dim=1).mean().exp()
                          for p, lp in zip(prob.chunk(10), log_prob.chunk(10), strict=True)])
    return float(scores.mean()), float(scores.std())


def _statistics(logits, split_of, dtype, chunk: int) -> SplitStatistics:
    statistics = SplitStatistics(split_of, 10, dtype)
    for start in range(0, len(logits), chunk):
        statistics.add(torch.arange(start, min(start + chunk, len(logits))),
                       logits[start:start + chunk])
    return statistics


@pytest.mark.parametrize("n,classes", [(13, 7), (23, 7), (400, 1008)])
def test_split_statistics_give_torch_fidelitys_inception_score(n, classes):
    logits = torch.randn(n, classes, generator=torch.Generator().manual_seed(n)) * 3
    library = isc_features_to_metric(logits[text_order(n)], splits=10, shuffle=True,
                                     rng_seed=SHUFFLE_SEED)
    scores, counts = _statistics(logits, fidelity_split_of(n, 10), torch.float64,
                                 5).scores_all_ranks(Runtime())
    assert counts.tolist() == [(i + 1) * n // 10 - i * n // 10 for i in range(10)]
    assert np.mean(scores.tolist()) == pytest.approx(library["inception_score_mean"], rel=1e-13)
    assert np.std(scores.tolist()) == pytest.approx(library["inception_score_std"], rel=1e-11)


def test_split_statistics_follow_torch_chunk_and_the_seed():
    """The "pil" protocol: torchmetrics' permutation and torch.chunk (23 rows: 8 splits of 3)."""
    logits = torch.randn(23, 7, generator=torch.Generator().manual_seed(1)) * 2
    split_of = pil_split_of(23, 10, seed=5)
    assert torch.bincount(split_of.long()).tolist() == [3] * 7 + [2]
    scores, counts = _statistics(logits, split_of, torch.float32, 4).scores_all_ranks(Runtime())
    scores = scores[counts > 0]
    mean, std = _torchmetrics_is(logits, 5)
    assert float(scores.mean()) == pytest.approx(mean, rel=1e-6)
    assert float(scores.std()) == pytest.approx(std, rel=1e-5)
    assert not torch.equal(pil_split_of(23, 10, seed=6), split_of)


def test_split_statistics_do_not_depend_on_chunks_or_their_order():
    logits = torch.randn(97, 50, generator=torch.Generator().manual_seed(2)) * 4
    split_of = fidelity_split_of(97, 10)
    whole = _statistics(logits, split_of, torch.float64, 97).scores_all_ranks(Runtime())[0]
    backwards = SplitStatistics(split_of, 10, torch.float64)
    for start in reversed(range(0, 97, 7)):
        backwards.add(torch.arange(start, min(start + 7, 97)), logits[start:start + 7])
    assert torch.equal(backwards.scores_all_ranks(Runtime())[0], whole)


# --------------------------------------------------------------------------------------------
# Real processes
# --------------------------------------------------------------------------------------------
def _ranks_worker(out_dir: str) -> None:
    runtime = rd.setup_distributed()
    torch.set_num_threads(1)
    generated, real = _features(700, 650, 48, seed=3)
    precision, recall = knn.precision_recall_all_ranks(runtime, generated, real, K)
    logits = torch.randn(101, 30, generator=torch.Generator().manual_seed(4)) * 3
    statistics = SplitStatistics(fidelity_split_of(101, 10), 10, torch.float64)
    for start in range(runtime.rank * 8, 101, runtime.world_size * 8):  # eval_chunks' layout
        statistics.add(torch.arange(start, min(start + 8, 101)), logits[start:start + 8])
    scores, _ = statistics.scores_all_ranks(runtime)
    torch.save({"precision": precision, "recall": recall, "scores": scores},
               os.path.join(out_dir, f"w{runtime.world_size}_rank{runtime.rank}.pt"))
    rd.teardown(runtime)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_same_numbers_on_1_2_3_processes(tmp_path):
    for world in (1, 2, 3):
        spawn_ranks(_ranks_worker, world, str(tmp_path))
    generated, real = _features(700, 650, 48, seed=3)
    library = calculate_precision_recall_part(generated, real, K, 10000)
    logits = torch.randn(101, 30, generator=torch.Generator().manual_seed(4)) * 3
    library_is = isc_features_to_metric(logits[text_order(101)], splits=10, shuffle=True,
                                        rng_seed=SHUFFLE_SEED)
    single = torch.load(tmp_path / "w1_rank0.pt")
    assert (single["precision"], single["recall"]) == library
    assert np.mean(single["scores"].tolist()) == pytest.approx(
        library_is["inception_score_mean"], rel=1e-13)
    for world in (2, 3):
        for rank in range(world):
            result = torch.load(tmp_path / f"w{world}_rank{rank}.pt")
            assert (result["precision"], result["recall"]) == library, (world, rank)
            assert torch.equal(result["scores"], single["scores"]), (world, rank)


def _memory_worker(out_dir: str, n: int) -> None:
    runtime = rd.setup_distributed()
    torch.set_num_threads(1)
    knn.ROW_BLOCK, knn.COL_BLOCK = 512, 1024  # this process's own copy of the module: 2 MB
    generated, real = _features(n, n, 16, seed=5)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, the peak so far
    knn.precision_recall_all_ranks(runtime, generated, real, K)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    torch.save(grown * 1024, os.path.join(out_dir, f"n{n}_rank{runtime.rank}.pt"))
    rd.teardown(runtime)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_working_memory_does_not_grow_with_the_rows(tmp_path):
    """8000 rows a set on 2 ranks, with 512 x 1024 blocks: the library's step holds an N x N
    float32 distance matrix (256 MB); a rank here grows its peak by the blocks (2 MB of
    distances and their copies) and its allocator's slack: ~18 MB at 2000 rows, ~20 MB at 8000
    and ~27 MB at 16000 when measured (peak RSS is coarse: the bound is loose)."""
    spawn_ranks(_memory_worker, 2, str(tmp_path), 8000)
    grown = [torch.load(tmp_path / f"n8000_rank{r}.pt") for r in range(2)]
    assert max(grown) < 64 * 2**20, grown
