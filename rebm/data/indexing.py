"""Which dataset index goes to which rank at which step, and the per-sample random keys.

Everything here is a pure function of (seed, stream, epoch, position), so the global batch of a
step is the same on any world size, any worker count, and after a resume.

Shuffle: a keyed bijection on [0, n) (a balanced Feistel network on the next even power of two,
with cycle-walking back into [0, n)). It costs O(1) memory and evaluates only the positions a step
needs, so an 80M-record out-distribution set is shuffled as cheaply as CIFAR — no
`randperm(n).tolist()` of n Python ints per epoch.

Sharding (the layout of `DistributedSampler` with drop_last, made explicit): the global batch of
step s in an epoch is the contiguous block of positions [s*B, (s+1)*B) of that epoch's
permutation. Rank r takes the positions of the block that are ≡ r (mod world_size), in order;
its micro-step m is chunk m (of per_device_batch_size) of those. The union over ranks and
micro-steps is exactly the block, whatever the world size.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, List, Tuple

import numpy as np

_U64 = np.uint64
_MASK63 = _U64((1 << 63) - 1)

# Distinct codes for the independent random streams (so their shuffles/keys never coincide).
STREAM_CODES = {
    "in": 1,  # EBM in-distribution stream (generation augmentation)
    "clf": 2,  # classifier in-distribution stream (classification augmentation)
    "out": 3,  # out-distribution stream
    "noise": 4,  # content of procedurally generated noise images (independent of epoch)
    "eval": 5,
}


def stream_code(stream: str) -> int:
    """The code of a named stream: STREAM_CODES, else (a stream a method declares itself) a hash
    of its name, above the fixed codes."""
    if stream in STREAM_CODES:
        return STREAM_CODES[stream]
    digest = hashlib.blake2b(f"rebm-stream:{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") | (1 << 62)


# Salts that separate what a key is used for (the key handed to the attack vs. the seed of the
# augmentation draws), so the two never share random numbers.
PURPOSE_SAMPLE = 0
PURPOSE_AUGMENT = 1


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (array arithmetic wraps mod 2**64 silently)."""
    z = np.asarray(x, dtype=_U64) + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def _as_u64(value: int) -> np.ndarray:
    return np.array([value & 0xFFFFFFFFFFFFFFFF], dtype=_U64)


def sample_keys(
    seed: int, stream: str, epoch: int, indices: Iterable[int], purpose: int = PURPOSE_SAMPLE
) -> np.ndarray:
    """int64 keys (non-negative, 63 bit) from (seed, stream, epoch, index, purpose), vectorised."""
    head = _mix64(_as_u64(seed))
    head = _mix64(head ^ _as_u64(stream_code(stream)))
    head = _mix64(head ^ _as_u64(epoch))
    head = _mix64(head ^ _as_u64(purpose))
    idx = np.asarray(indices, dtype=np.int64).astype(_U64)
    return (_mix64(head ^ idx) & _MASK63).astype(np.int64)


def _round_keys(seed: int, stream: str, epoch: int, rounds: int) -> np.ndarray:
    """Feistel round keys; hashlib (not Python's salted hash) so they are identical everywhere."""
    digest = hashlib.blake2b(
        f"rebm-shuffle:{seed}:{stream}:{epoch}".encode(), digest_size=8 * rounds
    ).digest()
    return np.frombuffer(digest, dtype="<u8").astype(_U64)


class KeyedPermutation:
    """A pseudo-random bijection of [0, n), evaluated element-wise: `perm(positions) -> indices`.

    Balanced Feistel network on 2*h bits (4**h >= n, so the domain is < 4n) with cycle-walking:
    values that land outside [0, n) are encrypted again until they fall inside, which keeps the
    map a bijection of [0, n) and needs fewer than 4 rounds-trips on average.
    """

    ROUNDS = 6

    def __init__(self, n: int, seed: int, stream: str, epoch: int):
        if n <= 0:
            raise ValueError(f"cannot permute an empty range (n={n})")
        self.n = n
        self.half_bits = max(1, (int(n - 1).bit_length() + 1) // 2)
        self.keys = _round_keys(seed, stream, epoch, self.ROUNDS)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        h = _U64(self.half_bits)
        mask = _U64((1 << self.half_bits) - 1)
        left, right = x >> h, x & mask
        for key in self.keys:
            left, right = right, left ^ (_mix64(right ^ key) & mask)
        return (left << h) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= self.n):
            raise IndexError(f"positions must lie in [0, {self.n})")
        out = self._encrypt(pos.astype(_U64))
        outside = out >= _U64(self.n)
        while outside.any():  # cycle-walk the few values that left [0, n)
            out[outside] = self._encrypt(out[outside])
            outside = out >= _U64(self.n)
        return out.astype(np.int64)


@dataclass(frozen=True)
class StreamSchedule:
    """Where step s of one training stream reads: epoch and this rank's dataset indices.

    Each stream (EBM in-dist, classifier in-dist, out-dist) has its own length n and therefore its
    own epochs; `steps_per_epoch = n // global_batch` (drop_last).
    """

    n: int
    global_batch: int
    seed: int
    stream: str

    @property
    def steps_per_epoch(self) -> int:
        return self.n // self.global_batch

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def rank_indices(
        self, step: int, rank: int, world_size: int, micro: int, per_device: int
    ) -> Tuple[np.ndarray, int]:
        """(dataset indices, epoch) of micro-step `micro` of `rank` at optimizer step `step`."""
        epoch, local_step = divmod(step, self.steps_per_epoch)
        positions = rank_positions(
            local_step * self.global_batch, rank, world_size, micro, per_device
        )
        return KeyedPermutation(self.n, self.seed, self.stream, epoch)(positions), epoch


def rank_positions(
    block_start: int, rank: int, world_size: int, micro: int, per_device: int
) -> np.ndarray:
    """Positions of rank `rank`, micro-step `micro` inside the global block starting at
    `block_start` (see the module docstring): block_start + rank + world_size * i for
    i in [micro * per_device, (micro + 1) * per_device)."""
    i = np.arange(micro * per_device, (micro + 1) * per_device, dtype=np.int64)
    return block_start + rank + world_size * i


def eval_shard(n: int, rank: int, world_size: int) -> range:
    """Evaluation indices of a rank: rank, rank + W, ... — every index exactly once over ranks,
    no padding duplicates (unlike DistributedSampler, which pads to a multiple of W)."""
    return range(rank, n, world_size)


def eval_chunks(n: int, chunk: int, rank: int, world_size: int) -> List[range]:
    """Evaluation chunks of a rank: [k·chunk, (k+1)·chunk) ∩ [0, n) for k = rank, rank + W, ...
    Every chunk holds the same positions on any world size, so work done per chunk (a batch of
    attacks, of generated samples, of features) does not depend on the world size."""
    starts = range(rank * chunk, n, world_size * chunk)
    return [range(s, min(s + chunk, n)) for s in starts]
