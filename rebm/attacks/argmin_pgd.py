"""In-N-Out's "argmin" PGD: the adversarial-training attack of stage 1.

In-N-Out (the original's InNOutRobustness/, the code that made the paper's stage-1 models)
attacks the in-distribution batch with its ArgminPGD by default (`--id_pgd argmin`,
utils/run_file_helpers.py:82, built at :281 with normalize_gradient=True; momentum 0.9, the
default of utils/train_types/helpers.py:59). What sets it apart from rebm's plain PGD
(rebm/attacks/pgd.py), each from utils/adversarial_attacks/argmin_pgd.py:

- momentum: the velocity accumulates L1-normalised gradients, v <- mu * v + g / (||g||_1 + 1e-10),
  and the step follows v normalised (L2: v / ||v||_2; Linf: sign(v));
- the perturbation delta = x_adv - x is the variable: each step projects delta onto the
  eps-ball (L2: torch.renorm) and then onto the image box as clamp(x + delta, 0, 1) - x;
- it returns the BEST iterate, per sample, of the K + 1 it evaluates (iteration 0, the start
  point, included): the one of highest cross-entropy, the first on ties. It takes K + 1
  forwards and K backwards; plain PGD returns the last iterate after K of each.

The arithmetic is written in the original's order (the mean of the loss over In-N-Out's batch,
delta as the variable, renorm then box clamp) so that the same weights and inputs give the same
bits; the stage-1 twin (tests/test_stage1_twin.py) compares it with the original's training
step. In-N-Out attacks its whole batch as one (`bs` images through DataParallel; at test time
its test loader's batches of `bs`, the last one shorter): the mean is over that batch, not over
rebm's micro-batch, through the per-sample weights 1/N of `ce_weights` (`ce_batch_sizes`).
Knows nothing of processes: pass the unwrapped module, in the mode the caller chose.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rebm.attacks.pgd import (
    NORMS,
    CEBatchSizes,
    ce_batch_sizes_on,
    ce_weights,
    input_gradients_only,
    pgd_from_config,
    random_start,
)

MOMENTUM = 0.9  # utils/train_types/helpers.py:59, the default every In-N-Out attack gets
ATTACK_TYPES = ("pgd", "argmin_pgd")  # the values of an attack section's attack_type


def _flat_per_sample(v: Tensor) -> Tensor:
    return v.reshape(v.shape[0], -1)


def _unit_step(velocity: Tensor, norm: str) -> Tensor:
    """The direction the perturbation moves along: v / ||v||_2 per sample (torch's normalize,
    whose denominator is max(||v||, 1e-12)), or sign(v) for Linf."""
    if norm == "Linf":
        return velocity.sign()
    return F.normalize(_flat_per_sample(velocity), p=2, dim=1).view_as(velocity)


def _project_delta(delta: Tensor, eps: float, norm: str) -> Tensor:
    """delta onto the eps-ball (eps = inf: unchanged): renorm for L2, clamp for Linf."""
    if math.isinf(eps):
        return delta
    if norm == "Linf":
        return delta.clamp(-eps, eps)
    return torch.renorm(delta, p=2, dim=0, maxnorm=eps)


def argmin_pgd_attack(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    steps: int,
    step_size: float,
    eps: float = math.inf,
    norm: str = "L2",
    momentum: float = MOMENTUM,
    random_start_keys: Optional[Tensor] = None,
    ce_batch_sizes: CEBatchSizes = None,
) -> Tensor:
    """The best (highest cross-entropy) of the K + 1 iterates of momentum PGD from x (or from
    the keyed random start), per sample; a detached tensor. steps == 0: the start point.
    ce_batch_sizes: the gradient is that of In-N-Out's mean over a batch of this many samples
    (int or one per sample; default: `x` as one batch). The model's train/eval mode is left as
    the caller set it."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    x0 = x.detach()
    delta = torch.zeros_like(x0) if random_start_keys is None else \
        random_start(x0, random_start_keys, eps, norm) - x0
    delta = _project_delta(delta, eps, norm)
    best_delta = torch.zeros_like(x0)
    best_loss = torch.full((x0.shape[0],), -math.inf, device=x0.device)
    velocity = torch.zeros_like(x0)
    ce_batch_sizes = ce_batch_sizes_on(ce_batch_sizes, x0.device)
    with input_gradients_only(model):
        for i in range(steps + 1):
            delta = delta.detach().requires_grad_(True)
            with torch.enable_grad():
                loss = F.cross_entropy(model(x0 + delta).float(), y, reduction="none")
                better = loss.detach() > best_loss  # strict: the earlier iterate keeps a tie
                best_loss = torch.where(better, loss.detach(), best_loss)
                best_delta = torch.where(better.view(-1, *[1] * (x0.dim() - 1)),
                                         delta.detach(), best_delta)
                if i == steps:
                    break
                (grad,) = torch.autograd.grad((loss * ce_weights(loss, ce_batch_sizes)).sum(),
                                              delta)
            with torch.no_grad():
                l1 = 1e-10 + _flat_per_sample(grad.abs()).sum(dim=1).view(-1, *[1] * (x0.dim() - 1))
                velocity = momentum * velocity + grad / l1
                delta = delta.detach() + step_size * _unit_step(velocity, norm)
                delta = _project_delta(delta, eps, norm)
                delta = torch.clamp(x0 + delta, 0.0, 1.0) - x0
    return (x0 + best_delta).detach()


def attack_from_config(
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
    """The attack an AttackConfig's `attack_type` names: "pgd" (rebm.attacks.pgd's
    `pgd_from_config`, same arguments) or "argmin_pgd" (cross-entropy only)."""
    if attack_cfg.attack_type != "argmin_pgd":
        return pgd_from_config(model, x, attack_cfg, objective=objective, y=y, steps=steps,
                               random_start_keys=random_start_keys, ce_batch_sizes=ce_batch_sizes)
    if objective != "ce" or y is None:
        raise ValueError(f"attack_type 'argmin_pgd' attacks the cross-entropy of the labels "
                         f"(objective 'ce' with y), got objective {objective!r}")
    if attack_cfg.random_start and random_start_keys is None:
        raise ValueError("random_start needs per-sample random_start_keys")
    return argmin_pgd_attack(
        model, x, y, steps=attack_cfg.max_steps if steps is None else steps,
        step_size=attack_cfg.step_size, eps=attack_cfg.eps, norm=attack_cfg.norm,
        random_start_keys=random_start_keys if attack_cfg.random_start else None,
        ce_batch_sizes=ce_batch_sizes)
