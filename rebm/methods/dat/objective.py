"""The DAT losses (docs/design.md §1, steps 2-3) as pure functions of (model, tensors).

Adding a loss term is a change here — compute it in `dat_loss`, add it to the total and to
`DATLoss.terms` — plus its config field; the method (dat.py) logs every term.

Every loss is a mean over the micro-batch it is given, so with equal micro-batches
`sum(loss_i) / accumulation_steps` has exactly the gradient of the full-batch loss.

`fused=True` runs one forward over the concatenated streams. That is only equivalent to separate
forwards when the batch composition does not matter (BatchNorm frozen / eval, `use_batchnorm:
false`); with live BatchNorm pass `fused=False`. When `r1reg > 0` the in-distribution batch always
gets its own forward, so the double backward of the R1 term only runs through that part.

`r1_penalty` measures the R1 penalty without training on it (`track_r1`): a separate,
side-effect-free input-gradient pass, so the training arithmetic is untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rebm.attacks.pgd import input_gradients_only
from rebm.config import ModelConfig
from rebm.config.sections import MethodSection
from rebm.methods.dat.rules import loss_weights


@dataclass
class EBMLoss:
    loss: Tensor  # bce + r1: what to backpropagate
    bce: Tensor  # weighted BCE of the energy scores (the metric `train_ebm_binary_loss`)
    r1: Tensor  # r1reg * 1/2 * mean ||grad_x s(x_in)||^2 (zero when r1reg == 0)
    score_in: Tensor  # detached s(x_in)
    logit_in: Tensor  # detached f_y(x_in): positives of the curriculum's AUC
    logit_adv: Tensor  # detached f_y(x_adv): its negatives
    score_out: Optional[Tensor] = None  # detached s(x_out), only when the clean-out term is on


@dataclass
class ClfLoss:
    loss: Tensor  # CE(f(x), y), mean over the batch
    logits: Tensor  # detached f(x); no step reads them (DAT logs no train accuracy)


@dataclass
class DATLoss:
    loss: Tensor  # the sum of `terms`
    ebm: EBMLoss
    clf: ClfLoss

    @property
    def terms(self) -> Dict[str, Tensor]:
        """Every loss term by name; the step logs each as `train_<name>_loss`."""
        return {"ebm_binary": self.ebm.bce, "r1": self.ebm.r1, "clf": self.clf.loss}


def _score(logits: Tensor, y: Optional[Tensor], logsumexp: bool) -> Tensor:
    if logsumexp:
        return torch.logsumexp(logits, dim=1)
    return logits.gather(1, y[:, None]).squeeze(1)


def energy(model: nn.Module, x: Tensor, y: Optional[Tensor], logsumexp: bool) -> Tensor:
    """s(x) = logsumexp_k f_k(x) if logsumexp else f_y(x) (one value per sample)."""
    return _score(model(x), y, logsumexp)


def r1_penalty(model: nn.Module, x_in: Tensor, y_in: Tensor, logsumexp: bool) -> Tensor:
    """1/2 mean_i ||grad_x s(x_in_i)||^2, unweighted and detached: the value `track_r1` logs.

    Like the attacks it takes the gradient w.r.t. the input only, with the parameters'
    requires_grad off for the pass: no parameter gradient, no graph kept, no random numbers, so
    the training step is bit-identical with or without it. The model's train/eval mode is the
    caller's (the DAT step measures in eval mode, so live BatchNorm statistics never move; with
    frozen BatchNorm that equals the training forward)."""
    x = x_in.detach().requires_grad_(True)
    with input_gradients_only(model), torch.enable_grad():
        (grad,) = torch.autograd.grad(energy(model, x, y_in, logsumexp).sum(), x)
    return (0.5 * grad.flatten(1).pow(2).sum(1).mean()).detach()


def _forward(model: nn.Module, xs: Sequence[Tensor], fused: bool, own_first: bool) -> List[Tensor]:
    """Logits of each stream; one forward over the concatenation when fused."""
    if not fused:
        return [model(x) for x in xs]
    head, rest = (list(xs[:1]), list(xs[1:])) if own_first else ([], list(xs))
    out = [model(x) for x in head]
    if rest:
        out += list(model(torch.cat(rest)).split([len(x) for x in rest]))
    return out


def _ebm_from_logits(
    logits: Sequence[Tensor],
    x_in: Tensor,
    y_in: Tensor,
    weights: Tuple[float, float, float],
    logsumexp: bool,
    r1reg: float,
) -> EBMLoss:
    w_in, w_out, w_adv = weights
    scores = [_score(lg, y_in, logsumexp) for lg in logits]  # [in, adv(, out)]
    stream_w = [w_in, w_adv, w_out][: len(scores)]
    targets = [torch.ones_like(scores[0])] + [torch.zeros_like(s) for s in scores[1:]]
    # Per-element weight w_s * N / n_s turns the mean over all N elements into
    # sum_s w_s * mean_s(BCE). The default (0.5, 0, 0.5) gives weight exactly 1.0 everywhere:
    # bit for bit the plain BCE mean over [s(x_in); s(x_adv)].
    n_total = sum(len(s) for s in scores)
    elem_w = torch.cat(
        [torch.full_like(s, w * n_total / len(s)) for s, w in zip(scores, stream_w, strict=True)]
    )
    bce = F.binary_cross_entropy_with_logits(torch.cat(scores), torch.cat(targets), weight=elem_w)
    if r1reg > 0:
        # create_graph: the penalty is part of the loss and must train the parameters
        (grad,) = torch.autograd.grad(scores[0].sum(), x_in, create_graph=True)
        r1 = r1reg * 0.5 * grad.flatten(1).pow(2).sum(1).mean()
    else:
        r1 = bce.new_zeros(())
    fy = [lg.detach().gather(1, y_in[:, None]).squeeze(1) for lg in logits[:2]]
    return EBMLoss(
        loss=bce + r1,
        bce=bce,
        r1=r1,
        score_in=scores[0].detach(),
        logit_in=fy[0],
        logit_adv=fy[1],
        score_out=scores[2].detach() if len(scores) > 2 else None,
    )


def _ebm_inputs(x_in, x_adv, x_out, weights, r1reg):
    if len(weights) != 3:
        raise ValueError(f"weights must be (in, clean-out, adv), got {weights}")
    streams = [x_in.detach().requires_grad_(True) if r1reg > 0 else x_in, x_adv.detach()]
    if weights[1] > 0:  # the clean out-dist term costs a forward: only when it counts
        if x_out is None:
            raise ValueError("a positive clean out-dist weight needs x_out")
        streams.append(x_out.detach())
    return streams


def ebm_loss(
    model: nn.Module,
    x_in: Tensor,
    y_in: Tensor,
    x_adv: Tensor,
    x_out: Optional[Tensor] = None,
    *,
    weights: Tuple[float, float, float] = (0.5, 0.0, 0.5),
    logsumexp: bool = True,
    r1reg: float = 0.0,
    fused: bool = True,
) -> EBMLoss:
    """w_in*BCE(s(x_in), 1) + w_adv*BCE(s(x_adv), 0) + w_out*BCE(s(x_out), 0) (+ R1 term).

    weights = `loss_weights(method)` = (in, clean out, adv), normalised. x_adv (and x_out) are scored
    with the labels y_in (the negatives' target classes) when logsumexp is False.
    """
    streams = _ebm_inputs(x_in, x_adv, x_out, weights, r1reg)
    logits = _forward(model, streams, fused, own_first=r1reg > 0)
    return _ebm_from_logits(logits, streams[0], y_in, weights, logsumexp, r1reg)


def clf_loss(model: nn.Module, x: Tensor, y: Tensor) -> ClfLoss:
    """CE(f(x), y), mean over the batch; x is the adversarial classification batch."""
    logits = model(x)
    return ClfLoss(loss=F.cross_entropy(logits, y), logits=logits.detach())


def dat_loss(model: nn.Module, x_in: Tensor, y_in: Tensor, x_adv: Tensor, x_clf: Tensor,
             y_clf: Tensor, x_out: Optional[Tensor] = None, **options: Any) -> DATLoss:
    """ebm_loss + clf_loss; when fused, a single forward covers every stream (x_in apart if r1).
    `options`: weights, logsumexp, r1reg, fused, with the defaults of `ebm_loss`."""
    weights, logsumexp, r1reg, fused = _energy_options(**options)
    streams = _ebm_inputs(x_in, x_adv, x_out, weights, r1reg)
    logits = _forward(model, streams + [x_clf.detach()], fused, own_first=r1reg > 0)
    ebm = _ebm_from_logits(logits[:-1], streams[0], y_in, weights, logsumexp, r1reg)
    clf = ClfLoss(loss=F.cross_entropy(logits[-1], y_clf), logits=logits[-1].detach())
    return DATLoss(loss=ebm.loss + clf.loss, ebm=ebm, clf=clf)


def _energy_options(weights: Tuple[float, float, float] = (0.5, 0.0, 0.5), logsumexp: bool = True,
                    r1reg: float = 0.0, fused: bool = True) -> tuple:
    return weights, logsumexp, r1reg, fused


def loss_options(method: MethodSection, model: ModelConfig) -> Dict[str, Any]:
    """The objective's options from the method and model sections: the one place the DAT
    step's loss reads them. Fused forwards need frozen BatchNorm (the batch composition must not
    matter)."""
    return dict(weights=loss_weights(method), logsumexp=method.logsumexp, r1reg=method.r1reg,
                fused=not model.use_batchnorm)
