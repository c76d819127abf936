"""Exact sums over the ranks, for the metrics (rebm/eval/metric.py: results must not depend on
the world size).

A float64 sum depends on the order of its terms. A metric that keeps float64 running sums per
rank and all-reduces them adds its chunks in another order on every world size (and the backend
adds the ranks in its own order), so its value moves by round-off: FID of 4,000 stand-in samples
was 0.008963627721176426 on 1 process and 0.00896362822516733 on 2 (issue 40).

`ExactSums` keeps its sums as integers instead. Each value added is rounded once, to a multiple
of 2^-84, and held as three int64 digits of units 2^-20, 2^-52 and 2^-84. Integer addition is
associative, so the totals are the same integers whatever the order of the values, on a rank or
over the ranks (the all-reduce adds integers), and the float64 read at the end is the same on any
world size. What stays for the metric is to add the same values on any world size: values of one
sample, or of one evaluation chunk (chunk k holds the same samples on any number of ranks,
rebm/data/indexing.py `eval_chunks`), computed the same way wherever the chunk runs.

The arithmetic, and why it is exact:
- a value v is split as |v| 2^20 = d0 + (d1 + r 2^-32) 2^-32 with d0, d1 integers (floor) and r in
  [0, 2^32); scaling by a power of 2 and taking the fraction of a non-negative float64 are exact,
  so the only rounding is r to the nearest integer (d2): |error| <= 2^-85, and none when
  |v| >= 2^-32 (a float64 of that size is a multiple of 2^-84). Then the sign goes on each digit;
- d1 and d2 are at most 2^32 in magnitude per value, so an int64 digit takes 2^30 values before
  it could overflow; the digits are carried (d2 -> d1 -> d0, by 2^32) before that, and before the
  all-reduce, so a rank's low digits are in [0, 2^32) and W ranks' sum cannot overflow either;
- d0 holds |total| 2^20, so a total must stay below RANGE = 2^41 (about 2.2e12) in magnitude.
  Each rank bounds its totals by the sum over its adds of the largest |value| (times the rows of
  an indexed add); the bounds are summed in the same all-reduce, and a bound of RANGE or more, or
  a value that is not finite, is a ValueError on every rank of the run (the same answer on all;
  the bound is far from any total a metric keeps: features of 1e3 give FID moments of 5e10 at
  50,000 samples).

The totals are read as float64 from the carried digits (sign apart), within one or two units in
the last place of the exact integer total: the read is a function of the integers only, so it
is the same on every rank and world size.

Memory: three int64 per summed number (3 x the float64 sums it replaces; FID's (D+1)^2 moments at
D = 2048: 100 MB), plus the digits of the values being added and one float64 copy of them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from rebm.distributed import Runtime, all_reduce_max, all_reduce_sum

DIGIT_BITS = 32
TOP_SCALE = 2.0**20  # 1 / the unit of digit 0
RANGE = 2.0**41  # |total| must stay below this (digit 0 holds |total| x 2^20 < 2^61)
MAX_DIMS = 8  # dimensions of a sum's shape (the shape travels in a fixed-size tensor)
_CARRY_EVERY = 2**30  # values per digit between two carries: 2^30 x 2^32 < 2^63
_BOUND_CAP = 2**50  # a rank's range bound in the all-reduce (W < 2^12 ranks cannot overflow)


def _digits(values: Tensor) -> Tensor:
    """float64 values as (3, *shape) int64 digits (see the module's docstring). A value that is
    not finite or out of range gives the digits of +-RANGE or 0 (the caller's bound flags it)."""
    values = torch.nan_to_num(values, nan=0.0, posinf=RANGE, neginf=-RANGE).clamp_(-RANGE, RANGE)
    digits = torch.empty(3, *values.shape, dtype=torch.int64, device=values.device)
    rest = values.abs().mul_(TOP_SCALE)  # in place from here on: a copy of 8 bytes a value
    for k in range(3):
        digit = rest.floor() if k < 2 else rest.round()  # the last: the one rounding
        digits[k] = digit.copysign_(values)
        if k < 2:
            rest.sub_(digit.abs_()).mul_(2.0**DIGIT_BITS)  # exact: the fraction, times 2^32
    return digits


def _carry(digits: Tensor) -> None:
    """In place: digits 1 and 2 into [0, 2^32), the rest carried up (same integer total)."""
    for k in (2, 1):
        up = digits[k] >> DIGIT_BITS  # arithmetic shift: floor division by 2^32
        digits[k] -= up << DIGIT_BITS
        digits[k - 1] += up


def _to_float(digits: Tensor) -> Tensor:
    """float64 of carried digits: the magnitude's digits (non-negative after a carry), largest
    unit last so that the two small ones are added first."""
    negative = digits[0] < 0
    magnitude = torch.where(negative, -digits, digits)
    _carry(magnitude)
    value = magnitude[0].double() * 2.0**-20 + (magnitude[1].double() * 2.0**-52
                                                 + magnitude[2].double() * 2.0**-84)
    return torch.where(negative, -value, value)


class ExactSums:
    """Exact, order-independent float64 sums of a fixed shape (see the module's docstring).

    `add(values)` adds elementwise; `add(values, index)` adds row i of `values` to row index[i]
    of the sums (`index_add_`), for sums with `rows` rows given here. The shape comes from the
    first add (a rank that adds nothing takes the others'); `total_all_ranks` gives every rank
    the totals of all ranks."""

    def __init__(self, rows: Optional[int] = None) -> None:
        self.rows = rows
        self.buffer: Optional[Tensor] = None  # the digits, then this rank's range bound
        self.digits: Optional[Tensor] = None  # (3, *shape) int64, a view of the buffer
        self.bound = 0.0  # >= |any total| of this rank (RANGE checks)
        self.finite = True
        self.since_carry = 0  # values added to one digit since the last carry, at most

    def add(self, values: Tensor, index: Optional[Tensor] = None) -> None:
        values = values.detach().double()
        terms = 1 if index is None else values.shape[0]
        if self.digits is None:
            shape = tuple(values.shape) if index is None else (self.rows, *values.shape[1:])
            self._allocate(shape, values.device)
        if self.since_carry + terms > _CARRY_EVERY:
            _carry(self.digits)
            self.since_carry = 0
        self.since_carry += terms
        if values.numel():
            peak = float(values.abs().amax())
            self.finite = self.finite and math.isfinite(peak)
            self.bound += peak * terms if math.isfinite(peak) else 0.0
        digits = _digits(values).to(self.digits.device)
        if index is None:
            self.digits += digits
        else:
            self.digits.index_add_(1, index.to(self.digits.device), digits)

    def _allocate(self, shape, device) -> None:
        # one buffer for the digits and the range bound: the all-reduce sends it as it is
        self.buffer = torch.zeros(3 * math.prod(shape) + 1, dtype=torch.int64, device=device)
        self.digits = self.buffer[:-1].view(3, *shape)

    def total_all_ranks(self, runtime: Runtime) -> Optional[Tensor]:
        """The float64 totals of every rank's adds (on this rank's device), the same on every
        rank; None when no rank added anything. ValueError on every rank when a total may be
        out of range or a value was not finite. Every rank must call this."""
        mine = [] if self.digits is None else [len(self.digits.shape), *self.digits.shape[1:]]
        code = torch.tensor(mine + [0] * (MAX_DIMS + 1 - len(mine)))  # [1 + ndim, *shape] or 0s
        agreed = all_reduce_max(runtime, code.to(runtime.device)).tolist()
        if agreed[0] == 0:
            return None
        shape = agreed[1:agreed[0]]
        if self.digits is None:
            self._allocate(shape, runtime.device)
        _carry(self.digits)  # low digits in [0, 2^32): W ranks of them add up without overflow
        self.buffer[-1] = _BOUND_CAP if not self.finite else min(_BOUND_CAP,
                                                                   math.ceil(self.bound))
        packed = all_reduce_sum(runtime, self.buffer)
        if int(packed[-1]) >= RANGE:
            raise ValueError(f"a sum is not finite or may reach 2^41 in magnitude (bound "
                             f"{int(packed[-1])}), beyond the exact sums' range")
        total = packed[:-1].view(3, *shape)
        _carry(total)
        return _to_float(total)
