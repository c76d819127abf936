"""Several PGD attacks run as one batched pass (DAT's negatives and adversarial classifier batch).

While two or more attacks still have steps to go, their running samples go through the model as
one concatenated batch: one forward and one input gradient per step instead of one per attack.
Each sample keeps its own attack: the objective is the sum of each stream's objective over its
own rows of the logits (a cross-entropy stream keeps its per-sample 1/N weights, the original's
mean over its own batch), so (in eval mode, where a sample's logits depend on that sample
alone) each sample's gradient is exactly the one its own attack would take; the step and the
projection are then applied per stream with its norm, radius and step size. Once a stream has
taken its steps it leaves the batch and the others go on.

The result equals running `pgd_attack` on each stream separately up to the floating-point
rounding of a batched convolution (a kernel may block a batch of 2B differently from one of
B); random starts are drawn per stream from its per-sample keys exactly as `pgd_attack` draws
them, so they depend neither on the batch nor on the fusion.

The same contract as `pgd_attack`: the unwrapped module, input gradients only, train/eval mode
left as the caller set it, no host synchronisation in the step loop.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor, nn

from rebm.attacks.pgd import (
    AttackStream,
    ascent_step,
    ce_batch_sizes_on,
    check_attack_args,
    input_gradients_only,
    objective_of_logits,
    project,
    random_start,
)


def _mark_batch_dynamic(batch: Tensor) -> None:
    """A torch.compile'd model sees batches of the fused size (sum of the running streams)
    and of each stream alone (the tail, or a stream whose partner takes no steps): one graph
    with a symbolic batch size serves them all instead of one graph (or a recompile) per size.
    Outside torch.compile the mark is an unused attribute. A model that needs a fixed size
    gets it (maybe_: no error); sizes 0 and 1 are always specialised, so they are not marked.
    (A kernel choice that depends on the batch size still guards on it: on one CPU thread the
    convolution's backend changes below 16 images, where a smaller tail recompiles once.)"""
    if batch.shape[0] >= 2:
        torch._dynamo.maybe_mark_dynamic(batch, 0)


def _start(stream: AttackStream, x0: Tensor) -> Tensor:
    """pgd_attack's start: the keyed random point of the ball, or the clean input."""
    if stream.random_start_keys is None:
        return x0
    return random_start(x0, stream.random_start_keys, stream.eps, stream.norm)


def pgd_attack_streams(model: nn.Module, streams: Sequence[AttackStream]) -> List[Tensor]:
    """`pgd_attack(model, **stream)` for every stream, as one batched pass; detached results in
    the order of `streams`. A stream with steps == 0 returns a detached copy of its input."""
    for stream in streams:
        check_attack_args(stream.steps, stream.norm, stream.objective, stream.y,
                          stream.ce_batch_sizes)
    clean = [stream.x.detach() for stream in streams]
    ce_sizes = [ce_batch_sizes_on(s.ce_batch_sizes, s.x.device) for s in streams]
    x_adv = [x0 if s.steps == 0 else _start(s, x0) for s, x0 in zip(streams, clean, strict=True)]
    with input_gradients_only(model):
        for step in range(max((s.steps for s in streams), default=0)):
            running = [i for i, s in enumerate(streams) if s.steps > step]
            sizes = [x_adv[i].shape[0] for i in running]
            batch = torch.cat([x_adv[i].detach() for i in running]) if len(running) > 1 \
                else x_adv[running[0]].detach()
            batch.requires_grad_(True)
            _mark_batch_dynamic(batch)
            with torch.enable_grad():
                logits = model(batch)
                loss = sum(objective_of_logits(rows, streams[i].objective, streams[i].y,
                                               ce_sizes[i])
                           for i, rows in zip(running, logits.split(sizes), strict=True))
                (grad,) = torch.autograd.grad(loss, batch)
            for i, x_rows, g_rows in zip(running, batch.detach().split(sizes), grad.split(sizes),
                                         strict=True):
                s = streams[i]
                x_adv[i] = project(ascent_step(x_rows, g_rows, s.step_size, s.norm), clean[i],
                                   s.eps, s.norm)
    return [x.detach() if s.steps else x.clone() for s, x in zip(streams, x_adv, strict=True)]
