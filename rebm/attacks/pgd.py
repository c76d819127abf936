"""Projected gradient ascent (PGD) on the input of a classifier.

DAT uses it three ways: class-conditional logit ascent f_y(x) (negatives, sample generation),
logsumexp ascent LSE_k f_k(x) (`logsumexp_sampling`), and untargeted cross-entropy ascent
(adversarial training, robust evaluation). OOD evaluation also ascends the KL divergence of the
softmax from the uniform distribution (raising the max-softmax of out-distribution images).

The logit, logsumexp and KL objectives are batch sums, as the original's. The cross-entropy is
the original's batch MEAN (its pgd_attack_xent): each sample's term is weighted by 1/N, N the
size of the batch the original attacked it in (`ce_weights`), which rebm knows from the config
and the sample's place, not from its own ranks, micro-batches or fused passes.

Contract with callers:
- Gradients are taken w.r.t. the input only (`torch.autograd.grad(loss, x)`): no parameter's
  `.grad` is touched and weight gradients are not even computed (the parameters stop requiring
  gradients during the attack, which a torch.compile'd backward needs to skip them too).
- Pass the *unwrapped* module, never a DDP wrapper (a grad-enabled forward through DDP arms a
  collective; a rank-local one can deadlock).
- The model's train/eval mode is left exactly as the caller set it. In train mode with live
  BatchNorm every attack forward updates the running statistics; choose the mode before calling.
- No host synchronisation inside the step loop: only Python-side decisions on Python numbers.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, fields
from typing import Iterator, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

OBJECTIVES = ("logit", "lse", "ce", "uniform_kl")
NORMS = ("L2", "Linf")
_TINY = 1e-12  # a zero direction gives a zero random start instead of 0/0
_L2_OFFSET = 1e-10  # the original's g / (||g|| + 1e-10) (attack_steps.py:152-154)

# The size of the batch whose mean cross-entropy the original attacked, one int for all samples
# or one per sample; None: the samples given are that batch.
CEBatchSizes = Union[int, Tensor, None]


def ce_weights(per_sample: Tensor, batch_sizes: CEBatchSizes) -> Tensor:
    """1/N per sample, divided in the dtype and on the device of the per-sample losses.

    The original's mean cross-entropy seeds each sample's backward with 1/N (nll_loss's backward
    divides its incoming 1 by the batch's total weight N); sum_i CE_i * w_i with w_i this same
    quotient seeds the same bits, whichever rows rebm computes together. A sum would seed 1 and
    differ by the factor N: exactly only when N is a power of two.
    """
    like = dict(dtype=per_sample.dtype, device=per_sample.device)
    if isinstance(batch_sizes, Tensor):  # on the device already (`ce_batch_sizes_on`)
        sizes = batch_sizes.to(per_sample.dtype)
    else:  # a fill, not a copy from the host
        sizes = torch.full((), per_sample.shape[0] if batch_sizes is None else batch_sizes, **like)
    return torch.ones((), **like) / sizes


def ce_batch_sizes_on(batch_sizes: CEBatchSizes, device: torch.device) -> CEBatchSizes:
    """Per-sample sizes moved to `device` once, before the step loop (no copy per step)."""
    return batch_sizes.to(device) if isinstance(batch_sizes, Tensor) else batch_sizes


def attack_objective(model: nn.Module, x: Tensor, objective: str, y: Optional[Tensor],
                     ce_batch_sizes: CEBatchSizes = None) -> Tensor:
    """The quantity PGD ascends (`objective_of_logits` of the model's logits)."""
    return objective_of_logits(model(x), objective, y, ce_batch_sizes)


def objective_of_logits(logits: Tensor, objective: str, y: Optional[Tensor],
                        ce_batch_sizes: CEBatchSizes = None) -> Tensor:
    """The batch sum of the per-sample objective; for "ce", the sum of CE_i / N_i (the
    original's mean over its batch of N_i, see `ce_weights`). Either way each sample's gradient
    is its own."""
    if objective == "logit":
        return logits.gather(1, y[:, None]).sum()
    if objective == "lse":
        return torch.logsumexp(logits, dim=1).sum()
    if objective == "uniform_kl":  # KL(U || softmax) = -log K - mean_k log p_k, per sample
        return -(F.log_softmax(logits, dim=1).mean(dim=1) + math.log(logits.shape[1])).sum()
    per_sample = F.cross_entropy(logits, y, reduction="none")
    return (per_sample * ce_weights(per_sample, ce_batch_sizes)).sum()


def _per_sample(v: Tensor, like: Tensor) -> Tensor:
    return v.view(-1, *([1] * (like.dim() - 1)))


def _l2_norm(v: Tensor) -> Tensor:
    return _per_sample(v.flatten(1).norm(dim=1), v)


def ascent_step(x: Tensor, grad: Tensor, step_size: float, norm: str) -> Tensor:
    """L2: x + g/(||g||_2 + 1e-10)*a (per sample); Linf: x + sign(g)*a. No clamp, no projection.

    The original's arithmetic, operation for operation (its rebm/attacks/attack_steps.py:147-155
    L2, :121-124 Linf): the same formula written another way (g*(a/||g||)) rounds differently,
    and 40 sampling steps amplify that into visibly different samples (docs/performance.md §8). A
    zero gradient gives a zero step (0/1e-10).
    """
    if norm == "L2":
        return x + grad / (_l2_norm(grad) + _L2_OFFSET) * step_size
    return x + grad.sign() * step_size


def project(x: Tensor, x0: Tensor, eps: float, norm: str) -> Tensor:
    """Project x onto the eps-ball around x0, then clamp to [0, 1].

    The original's arithmetic (attack_steps.py:141-145 L2, :115-119 Linf): subtract x0, shrink
    the difference (`Tensor.renorm`, per sample; a clamp for Linf), add x0 back, clamp. The
    round trip x0 + (x - x0) runs even at eps = inf, where the shrinking is an exact no-op: it
    moves values by up to an ulp (6e-8), and skipping it changes the samples as above.
    Clamping after projecting keeps both constraints: x0 lies in [0, 1], so the clamp only moves
    coordinates towards x0 and cannot leave the ball.
    """
    delta = x - x0
    if norm == "L2":
        delta = delta.renorm(p=2, dim=0, maxnorm=eps)
    else:
        delta = delta.clamp(-eps, eps)
    return (x0 + delta).clamp(0.0, 1.0)


# ---------------------------------------------------------------------------------------------
# Per-sample deterministic noise: a counter-based hash of (key, stream, element index), computed
# with exact int64 arithmetic on the tensor's own device. A sample's noise depends on its key
# only, never on the batch it sits in or on any global RNG state.
# ---------------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF


def _mul32(h: Tensor, c: int) -> Tensor:
    """(h * c) mod 2**32 for 0 <= h < 2**32 without int64 overflow (split c into 16-bit halves)."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(h: Tensor) -> Tensor:
    """A bijective 32-bit integer finaliser (xor-shift / multiply, 'lowbias32' constants)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


def keyed_uniform(keys: Tensor, n: int, stream: int = 0) -> Tensor:
    """(B,) int64 keys -> (B, n) float32 uniform in (0, 1), a pure function of (key, stream)."""
    keys = keys.to(torch.int64)
    lo, hi = keys & _M32, (keys >> 32) & _M32
    seed = _mix32(_mix32(hi ^ (stream & _M32)) ^ lo)[:, None]  # one 32-bit state per sample
    counter = torch.arange(n, device=keys.device, dtype=torch.int64)[None, :]
    h = _mix32(_mix32(counter ^ seed) ^ seed)
    return ((h >> 8).to(torch.float32) + 0.5) * 2.0**-24  # 24 random bits, exact in float32


def keyed_normal(keys: Tensor, n: int, stream: int = 0) -> Tensor:
    """(B, n) standard normal from per-sample keys (Box-Muller on two keyed uniform streams)."""
    u1 = keyed_uniform(keys, n, 2 * stream)
    u2 = keyed_uniform(keys, n, 2 * stream + 1)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


def random_start(x: Tensor, keys: Tensor, eps: float, norm: str) -> Tensor:
    """A random point of the eps-ball around x (clamped to [0, 1]), seeded per sample by `keys`.

    L2: uniform in the ball; Linf: uniform in the cube; eps = inf: uniform noise in [0, 1]
    (the ball is then the whole image box).
    """
    if keys.shape != (x.shape[0],):
        raise ValueError(
            f"random_start_keys must have shape ({x.shape[0]},), got {tuple(keys.shape)}"
        )
    keys = keys.to(x.device)
    d = math.prod(x.shape[1:])
    if math.isinf(eps):
        return keyed_uniform(keys, d).to(x.dtype).view_as(x)
    if norm == "L2":
        direction = keyed_normal(keys, d, stream=0)
        direction = direction / direction.norm(dim=1, keepdim=True).clamp_min(_TINY)
        radius = eps * keyed_uniform(keys, 1, stream=2) ** (1.0 / d)  # uniform in volume
        delta = direction * radius
    else:
        delta = eps * (2.0 * keyed_uniform(keys, d) - 1.0)
    return (x + delta.to(x.dtype).view_as(x)).clamp(0.0, 1.0)


@contextlib.contextmanager
def input_gradients_only(model: nn.Module) -> Iterator[None]:
    """The model's parameters stop requiring gradients for the duration, then get their flags
    back. Eager autograd skips weight gradients that `autograd.grad(loss, x)` does not ask for,
    but a torch.compile'd backward (AOTAutograd) computes the gradient of every input that
    requires one: without this, each compiled attack step would also compute all weight
    gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def check_attack_args(steps: int, norm: str, objective: str, y: Optional[Tensor],
                      ce_batch_sizes: CEBatchSizes = None) -> None:
    """One-line errors for an attack's arguments (shared by `pgd_attack` and the fused pass)."""
    if isinstance(ce_batch_sizes, Tensor) and y is not None and \
            ce_batch_sizes.shape != (y.shape[0],):
        raise ValueError(f"ce_batch_sizes must have shape ({y.shape[0]},), "
                         f"got {tuple(ce_batch_sizes.shape)}")
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if objective in ("logit", "ce") and y is None:
        raise ValueError(f"objective {objective!r} needs the labels y")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")


def pgd_attack(
    model: nn.Module,
    x: Tensor,
    *,
    steps: int,
    step_size: float,
    eps: float = math.inf,
    norm: str = "L2",
    objective: str = "logit",
    y: Optional[Tensor] = None,
    random_start_keys: Optional[Tensor] = None,
    ce_batch_sizes: CEBatchSizes = None,
) -> Tensor:
    """`steps` steps of projected gradient ascent from `x`; returns a detached tensor.

    objective: "logit" ascends f_y(x) (needs y), "lse" ascends logsumexp_k f_k(x), "ce" ascends
    CE(f(x), y) (needs y), "uniform_kl" ascends KL(uniform || softmax f(x)).
    ce_batch_sizes: "ce" ascends the original's mean CE over a batch of this many samples (an
    int, or (B,) one per sample: the original's batch each sample sat in); default B, `x` as
    one batch. Each step:
    x <- clamp(proj_eps(x + step), 0, 1), the step being a*g/(||g||_2 + 1e-10) (L2) or
    a*sign(g) (Linf), in the original's arithmetic (`ascent_step`, `project`). eps = inf: no
    shrinking, only the round trip through x - x0 and the [0, 1] clamp.
    random_start_keys: (B,) int64, one key per sample; the start point is drawn inside the
    eps-ball from that key alone (see `random_start`). steps == 0 returns x unchanged (a detached
    copy), with or without random start. Works under `torch.no_grad()` (grad is re-enabled
    locally) but not under `torch.inference_mode()`; the model's train/eval mode is not changed.
    """
    check_attack_args(steps, norm, objective, y, ce_batch_sizes)
    x0 = x.detach()
    if steps == 0:
        return x0.clone()
    x_adv = x0 if random_start_keys is None else random_start(x0, random_start_keys, eps, norm)
    ce_batch_sizes = ce_batch_sizes_on(ce_batch_sizes, x0.device)
    with input_gradients_only(model):
        for _ in range(steps):
            x_adv = x_adv.detach().requires_grad_(True)
            with torch.enable_grad():
                loss = attack_objective(model, x_adv, objective, y, ce_batch_sizes)
                (grad,) = torch.autograd.grad(loss, x_adv)
            x_adv = project(ascent_step(x_adv.detach(), grad, step_size, norm), x0, eps, norm)
    return x_adv.detach()


@dataclass(frozen=True)
class AttackStream:
    """One batch to attack and its attack: `pgd_attack`'s arguments (see there)."""

    x: Tensor
    steps: int
    step_size: float
    eps: float = math.inf
    norm: str = "L2"
    objective: str = "logit"
    y: Optional[Tensor] = None
    random_start_keys: Optional[Tensor] = None
    ce_batch_sizes: CEBatchSizes = None


def stream_from_config(
    x: Tensor,
    attack_cfg,
    *,
    objective: str,
    y: Optional[Tensor] = None,
    steps: Optional[int] = None,
    random_start_keys: Optional[Tensor] = None,
    ce_batch_sizes: CEBatchSizes = None,
) -> AttackStream:
    """The attack of `x` under the threat model of an AttackConfig (`attack` or
    `indist_attack_clf`). steps defaults to attack_cfg.max_steps (the curriculum passes its
    current T instead). The keys are used only when attack_cfg.random_start is set, and are then
    required. ce_batch_sizes: as `pgd_attack`'s."""
    if attack_cfg.attack_type != "pgd":
        raise ValueError(f"attack_type {attack_cfg.attack_type!r} is not supported; use 'pgd'")
    if attack_cfg.random_start and random_start_keys is None:
        raise ValueError("attack.random_start needs per-sample random_start_keys")
    return AttackStream(
        x=x,
        steps=attack_cfg.max_steps if steps is None else steps,
        step_size=attack_cfg.step_size,
        eps=attack_cfg.eps,
        norm=attack_cfg.norm,
        objective=objective,
        y=y,
        random_start_keys=random_start_keys if attack_cfg.random_start else None,
        ce_batch_sizes=ce_batch_sizes,
    )


def pgd_from_config(
    model: nn.Module,
    x: Tensor,
    attack_cfg,
    *,
    objective: str,
    y: Optional[Tensor] = None,
    steps: Optional[int] = None,
    random_start_keys: Optional[Tensor] = None,
    ce_batch_sizes: CEBatchSizes = None,
) -> Tensor:
    """`pgd_attack` of `stream_from_config(...)` (same arguments)."""
    return pgd_attack_stream(model, stream_from_config(
        x, attack_cfg, objective=objective, y=y, steps=steps, random_start_keys=random_start_keys,
        ce_batch_sizes=ce_batch_sizes))


def pgd_attack_stream(model: nn.Module, stream: AttackStream) -> Tensor:
    """`pgd_attack` with the arguments of `stream`."""
    return pgd_attack(model, **{f.name: getattr(stream, f.name) for f in fields(stream)})
