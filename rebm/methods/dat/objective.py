"""The DAT loss (docs/design.md §1, steps 2-3): its terms as data, over one loss pass.

A loss term is a `LossTerm` in `TERMS`: its name (logged as `train_<name>_loss`), its weight key
(the `MethodSection` field that weighs it) and its function of the loss pass's outputs
(`LossForward`) and that weight. Adding a term is its function, one entry in `TERMS` and its
config field; `loss_options` reads every weight, `dat_loss` computes and sums the terms in
`TERMS`' order, and the method (dat.py) logs each.

Every term is a mean over the micro-batch it is given, so with equal micro-batches
`sum(loss_i) / accumulation_steps` has exactly the gradient of the full-batch loss.

`fused` runs one forward over the concatenated streams. That is only equivalent to separate
forwards when the batch composition does not matter (BatchNorm frozen / eval, `use_batchnorm:
false`); with live BatchNorm it is off. When a weighted term differentiates with respect to x_in
(R1), the in-distribution batch always gets its own forward, so the double backward only runs
through that part.

`r1_penalty` measures the R1 penalty without training on it (`track_r1`): a separate,
side-effect-free input-gradient pass, so the training arithmetic is untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rebm.attacks.pgd import input_gradients_only
from rebm.config import ConfigError, ModelConfig
from rebm.config.layout import file_key
from rebm.config.origins import BUILT_IN_CODE, ConfigOrigins
from rebm.config.sections import MethodSection
from rebm.methods.dat.rules import energy_bce_weights


@dataclass
class LossForward:
    """What one loss pass computed, the input of every term's function."""

    x_in: Tensor  # the in-distribution batch as the model saw it (requires grad for R1)
    scores: List[Tensor]  # s(x) of the energy streams: [in, adv(, clean out)]
    bce_weights: Tuple[float, float, float]  # the energy BCE's (in, clean out, adv) weights
    clf_logits: Tensor  # f(x_c_adv), the adversarial classifier batch
    y_clf: Tensor  # its labels


@dataclass(frozen=True)
class LossTerm:
    """One term of the DAT loss. `weight_key` is the `MethodSection` field that weighs it (None:
    always on, weight 1); a term whose weight is 0 is a zero and is not computed. `value` returns
    the weighted term. `needs_input_grad`: it differentiates with respect to x_in."""

    name: str  # logged as train_<name>_loss
    weight_key: Optional[str]
    value: Callable[[LossForward, float], Tensor]
    needs_input_grad: bool = False


def energy_bce(out: LossForward, weight: float) -> Tensor:
    """w_in*BCE(s(x_in), 1) + w_adv*BCE(s(x_adv), 0) + w_out*BCE(s(x_out), 0). Weighted per
    stream by the clf_*_weight keys (`bce_weights`, which also decide whether the clean
    out-distribution stream is in the pass), so it has no weight key of its own."""
    w_in, w_out, w_adv = out.bce_weights
    scores = out.scores
    stream_w = [w_in, w_adv, w_out][: len(scores)]
    targets = [torch.ones_like(scores[0])] + [torch.zeros_like(s) for s in scores[1:]]
    # Per-element weight w_s * N / n_s turns the mean over all N elements into
    # sum_s w_s * mean_s(BCE). The default (0.5, 0, 0.5) gives weight exactly 1.0 everywhere:
    # bit for bit the plain BCE mean over [s(x_in); s(x_adv)].
    n_total = sum(len(s) for s in scores)
    elem_w = torch.cat(
        [torch.full_like(s, w * n_total / len(s)) for s, w in zip(scores, stream_w, strict=True)]
    )
    return F.binary_cross_entropy_with_logits(torch.cat(scores), torch.cat(targets), weight=elem_w)


def r1_regulariser(out: LossForward, weight: float) -> Tensor:
    """r1reg * 1/2 mean ||grad_x s(x_in)||^2 (the original's rebm/training/metrics.py:249)."""
    # create_graph: the penalty is part of the loss and must train the parameters
    (grad,) = torch.autograd.grad(out.scores[0].sum(), out.x_in, create_graph=True)
    return weight * 0.5 * grad.flatten(1).pow(2).sum(1).mean()


def classifier_ce(out: LossForward, weight: float) -> Tensor:
    """CE(f(x_c_adv), y_c), mean over the batch (the classifier stream; always weight 1)."""
    return F.cross_entropy(out.clf_logits, out.y_clf)


# The terms in the order they are computed and summed (the order fixes the arithmetic's bits).
# The first is always on: a zero-weight term is a zero of its dtype.
TERMS: Tuple[LossTerm, ...] = (
    LossTerm("ebm_binary", None, energy_bce),
    LossTerm("r1", "r1reg", r1_regulariser, needs_input_grad=True),
    LossTerm("clf", None, classifier_ce),
)


@dataclass(frozen=True)
class LossOptions:
    """What the loss reads of the config (`loss_options`)."""

    bce_weights: Tuple[float, float, float]  # normalised (in, clean out, adv): rules.py
    logsumexp: bool  # s(x) = logsumexp_k f_k(x); false: f_y(x)
    fused: bool  # one forward over the concatenated streams
    term_weights: Mapping[str, float]  # each term's weight by name

    @property
    def input_grad(self) -> bool:
        """A weighted term differentiates with respect to x_in: x_in gets its own forward."""
        return any(t.needs_input_grad and self.term_weights[t.name] > 0 for t in TERMS)


def loss_options(method: MethodSection, model: ModelConfig) -> LossOptions:
    """The loss's options from the method and model sections: the one place the DAT step's loss
    reads them. Fused forwards need frozen BatchNorm (the batch composition must not matter)."""
    return LossOptions(
        bce_weights=energy_bce_weights(method), logsumexp=method.logsumexp,
        fused=not model.use_batchnorm,
        term_weights={t.name: 1.0 if t.weight_key is None else getattr(method, t.weight_key)
                      for t in TERMS})


def check_term_weights(method: MethodSection, origins: ConfigOrigins = BUILT_IN_CODE) -> None:
    """A ConfigError naming the key and where it was set unless every term's weight is >= 0."""
    for term in TERMS:
        if term.weight_key is not None and not getattr(method, term.weight_key) >= 0:
            key = file_key(f"method.{term.weight_key}")
            raise ConfigError(f"{origins.of(key)}: '{key}' must be >= 0, got "
                              f"{getattr(method, term.weight_key)}")


@dataclass
class DATLoss:
    """What `dat_loss` returns: the loss to backpropagate, its terms and the AUC's scores."""

    loss: Tensor  # the sum of `terms`: what to backpropagate
    terms: Dict[str, Tensor]  # every term by name, in TERMS' order; logged as train_<name>_loss
    logit_in: Tensor  # detached f_y(x_in): positives of the curriculum's AUC
    logit_adv: Tensor  # detached f_y(x_adv): its negatives


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


def dat_loss(model: nn.Module, x_in: Tensor, y_in: Tensor, x_adv: Tensor, x_clf: Tensor,
             y_clf: Tensor, x_out: Optional[Tensor], options: LossOptions) -> DATLoss:
    """Every term of `TERMS` over one loss pass, and their sum. The pass scores x_in, the
    negatives x_adv (and the clean x_out when weighted) and classifies the adversarial batch
    x_clf; when fused, in a single forward (x_in apart when a term needs its input gradient).
    x_adv and x_out are scored with the labels y_in when not logsumexp."""
    streams = [x_in.detach().requires_grad_(True) if options.input_grad else x_in, x_adv.detach()]
    if options.bce_weights[1] > 0:  # the clean out-dist term costs a forward: only when it counts
        if x_out is None:
            raise ValueError("a positive clean out-dist weight needs x_out")
        streams.append(x_out.detach())
    logits = _forward(model, streams + [x_clf.detach()], options.fused,
                      own_first=options.input_grad)
    out = LossForward(x_in=streams[0],
                      scores=[_score(lg, y_in, options.logsumexp) for lg in logits[:-1]],
                      bce_weights=options.bce_weights, clf_logits=logits[-1], y_clf=y_clf)
    terms: Dict[str, Tensor] = {}
    total: Optional[Tensor] = None
    for term in TERMS:  # computed and summed in order, left to right
        weight = options.term_weights[term.name]
        value = term.value(out, weight) if weight > 0 else total.new_zeros(())
        terms[term.name] = value
        total = value if total is None else total + value
    fy = [lg.detach().gather(1, y_in[:, None]).squeeze(1) for lg in logits[:2]]
    return DATLoss(loss=total, terms=terms, logit_in=fy[0], logit_adv=fy[1])
