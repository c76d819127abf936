"""DAT, the method of stage 2 (docs/design.md §1): the losses of one step and its metrics.

It reads three input streams (`DAT.streams`: "in", "clf", "out"). Per micro-batch: negatives
x_adv = PGD_T(x_out) on f_y and the adversarial classifier batch
x_c_adv = PGD_K^CE(x_c), both on the module without DDP (whose forward arms collectives), compiled
if it is, in eval mode, and with `fuse_attacks` as one batched pass while both run
(`dat_attacks`); then the loss terms (objective.TERMS: energy BCE, R1, classifier CE) through
the wrapper, so the engine's backward all-reduces the gradients. After an applied step, the curriculum gets the AUC of the
all-gathered global batch, so T follows the same schedule on any number of ranks.

`track_r1` (with r1reg = 0): on metrics-log steps only, one more input-gradient pass per
micro-batch measures 1/2 mean ||grad_x s(x_in)||^2 (unweighted: the weight is 0) on the module the
attacks use, in eval mode, without touching parameters, their gradients or BatchNorm statistics;
it is logged as `train_r1_loss` (the mean over the window's log steps), never trained. With
r1reg > 0 the trained term r1reg * 1/2 mean ||grad||^2 is logged every step, as without it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from rebm.attacks.fused import pgd_attack_streams
from rebm.attacks.pgd import pgd_from_config, stream_from_config
from rebm.auc import binary_auc
from rebm.config import ConfigError, ModelConfig
from rebm.config.origins import BUILT_IN_CODE, ConfigOrigins
from rebm.config.sections import MethodSection, ScheduleSection
from rebm.data import CLASSIFIER, INDIST, OUTDIST, MicroBatch
from rebm.distributed.collectives import all_gather_cat
from rebm.distributed.runtime import Runtime
from rebm.methods.base import Method, MicroOutput, StepContext, StepResult, mean_terms
from rebm.methods.dat.curriculum import Curriculum
from rebm.methods.dat.objective import check_term_weights, dat_loss, loss_options, r1_penalty
from rebm.methods.dat.rules import check_energy_bce_weights, scores_clean_outdist
from rebm.methods.stages import STAGE2


def _fy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """f_y(x) in eval mode, without gradients (AUC scores when they cannot be reused)."""
    with torch.no_grad():
        return model(x).float().gather(1, y[:, None]).squeeze(1)


def resolve_fuse_attacks(setting: Union[bool, str], device: torch.device) -> bool:
    """`fuse_attacks` true/false as given; "auto": on for CUDA, off elsewhere.

    On a GPU each attack's small per-device batch leaves the device underfed and pays its own
    kernel launches: fused, the two attacks took 0.51-0.66x their separate time on an H100
    (T = K = 10, 16-128 images per stream). On a CPU two threads are already busy with 32
    images, and the fused pass measured 1.02-1.07x on an idle machine (docs/performance.md)."""
    if setting == "auto":
        return device.type == "cuda"
    return bool(setting)


def dat_attacks(model: torch.nn.Module, method: MethodSection, outdist_steps: int,
                batch: MicroBatch, fuse: bool, global_batch_size: int
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x_adv, x_c_adv) of one micro-batch on `model` (the attacked module, in the mode the
    caller set): negatives PGD_T(x_out) on f_y (the in-distribution labels) or logsumexp, and
    PGD_K^CE(x_c); with `fuse`, as one batched pass while both run (rebm.attacks.fused).
    The CE is the original's mean over the global batch (`global_batch_size`): its
    DataParallel model gathered the logits of the whole batch before the loss, whatever the
    number of GPUs; so every sample weighs 1/batch_size on any world size and micro-batch."""
    out, clf = batch[OUTDIST.name], batch[CLASSIFIER.name]
    attacks = (
        (out.images, method.attack, dict(
            steps=outdist_steps, y=batch[INDIST.name].labels, random_start_keys=out.keys,
            objective="lse" if method.logsumexp_sampling else "logit")),
        (clf.images, method.indist_attack_clf, dict(
            objective="ce", y=clf.labels, random_start_keys=clf.keys,
            ce_batch_sizes=global_batch_size)),
    )
    if fuse:
        x_adv, x_c_adv = pgd_attack_streams(
            model, [stream_from_config(x, threat, **kw) for x, threat, kw in attacks])
    else:
        x_adv, x_c_adv = (pgd_from_config(model, x, threat, **kw) for x, threat, kw in attacks)
    return x_adv, x_c_adv


class DAT(Method):
    name = "DAT"
    stage = STAGE2.number
    # the loss pass holds in-dist, negatives (from out-dist) and adversarial classifier batch
    streams = (INDIST, CLASSIFIER, OUTDIST)
    eval_samples = True
    keep_best = True
    # the original's loop: it evaluates at its first step (the starting model) and at the start
    # of each step that crosses an interval, before the update (rebm/training/train.py:498-581
    # and scheduling.py:72-74 of the original)
    events_at_step_start = True

    def __init__(self, method: MethodSection, model: ModelConfig, schedule: ScheduleSection):
        super().__init__(method, model, schedule)
        self.method_section, self.global_batch_size = method, schedule.batch_size
        self.curriculum = Curriculum.from_config(method, schedule.batch_size)
        self.loss_options = loss_options(method, model)
        self.frozen_bn = not model.use_batchnorm  # train-mode logits equal eval-mode ones
        self.track_r1 = method.track_r1 and not method.r1reg > 0  # measured, not trained

    @classmethod
    def check_config(cls, method: MethodSection, model: ModelConfig, schedule: ScheduleSection,
                     origins: ConfigOrigins = BUILT_IN_CODE) -> None:
        check_energy_bce_weights(method, origins)
        check_term_weights(method, origins)
        if method.indist_attack_clf.attack_type != "pgd":  # the fused pass and dat_attacks run PGD
            raise ConfigError(
                f"{origins.of('indist_attack_clf.attack_type')}: 'indist_attack_clf.attack_type' is "
                f"{method.indist_attack_clf.attack_type!r}; DAT's classifier attack is 'pgd' "
                "(argmin_pgd is stage 1's, InNOutRobustnessMean0_cifar100/train_at.py)")
        STAGE2.check(schedule, model, origins)  # a constant rate, on every path into DAT

    @classmethod
    def loss_streams(cls, method: MethodSection) -> int:
        """Plus the clean out-distribution images when they are weighted."""
        return len(cls.streams) + (1 if scores_clean_outdist(method) else 0)

    def micro_loss(self, ctx: StepContext, batch: MicroBatch, index: int, log_now: bool
                   ) -> MicroOutput:
        """Attacks -> the loss terms of one micro-batch (forward only). `log_now`
        adds the clean out-distribution scores (one more forward) and, with track_r1, the
        measured R1 penalty (one input-gradient pass)."""
        method = self.method_section
        x_in, y_in = batch[INDIST.name].images, batch[INDIST.name].labels
        clf, out = batch[CLASSIFIER.name], batch[OUTDIST.name]
        ctx.attacked.eval()
        with ctx.autocast():
            x_adv, x_c_adv = dat_attacks(ctx.attacked, method, self.curriculum.T, batch,
                                         resolve_fuse_attacks(method.fuse_attacks, ctx.device),
                                         self.global_batch_size)
        keep: Dict[str, torch.Tensor] = {}
        if log_now:
            keep["out"] = _fy(ctx.scorer, out.images, y_in)
            if self.track_r1:
                with ctx.autocast():
                    keep["r1"] = r1_penalty(ctx.attacked, x_in, y_in, method.logsumexp)
        if not self.frozen_bn:
            keep["in"] = _fy(ctx.scorer, x_in, y_in)
            keep["adv"] = _fy(ctx.scorer, x_adv, y_in)
        ctx.model.train()
        with ctx.autocast():
            losses = dat_loss(ctx.model, x_in, y_in, x_adv, x_c_adv, clf.labels,
                              out.images, self.loss_options)
        if self.frozen_bn:  # reuse the loss forward's f_y instead of a second forward
            keep["in"], keep["adv"] = losses.logit_in, losses.logit_adv
        if index == 0:
            keep["x_adv"] = x_adv.detach()
        terms = {name: term.detach() for name, term in losses.terms.items()}
        return MicroOutput(loss=losses.loss, terms=terms, keep=keep)

    def step_result(self, outputs: List[MicroOutput], micro_batches: List[MicroBatch]
                    ) -> StepResult:
        """Mean loss terms, the window's sums, the negatives to preview and the AUC scores."""
        terms = mean_terms(outputs)
        loss = sum(terms.values())  # the trained terms only
        # one host sync for the window's sums
        window = dict(zip(terms, torch.stack([v.float() for v in terms.values()]).tolist(),
                          strict=True))
        window["n"] = 1.0
        if "r1" in outputs[0].keep:  # track_r1 on a log step: averaged over such steps only
            terms["r1"] = torch.stack([o.keep["r1"] for o in outputs]).mean()
            window.update(r1=float(terms["r1"]), n_r1=1.0)
        scores = {k: torch.cat([o.keep[k] for o in outputs]).float()
                  for k in ("in", "adv", "out") if k in outputs[0].keep}
        return StepResult(loss=loss, losses=terms, window=window,
                          previews={"train_adv": outputs[0].keep["x_adv"]}, scores=scores)

    def after_step_all_ranks(self, runtime: Runtime, result: StepResult) -> Dict[str, Any]:
        """AUCs of the all-gathered global batch, then the curriculum's update; every rank."""
        outdist_steps = self.curriculum.T  # the T this step trained with
        adv_auc, clean_auc = global_aucs_all_ranks(runtime, result.scores)
        self.curriculum.update(adv_auc, self.global_batch_size)
        stats = {"train_adv_auc": adv_auc, "cur_outdist_steps": outdist_steps}
        if clean_auc is not None:
            stats["train_clean_auc"] = clean_auc
        return stats

    def summarize(self, totals: Dict[str, float]) -> Dict[str, float]:
        """Mean of each loss term (objective.TERMS) over ranks and steps: train_ebm_binary_loss,
        train_r1_loss, train_clf_loss. A term with its own count `n_<name>` (the tracked R1, measured on log
        steps only) is averaged over those."""
        return {f"train_{name}_loss": value / totals.get(f"n_{name}", totals["n"])
                for name, value in totals.items() if name != "n" and not name.startswith("n_")}

    def progress(self) -> Dict[str, Any]:
        window = self.curriculum.window
        return {"T": self.curriculum.T, "auc": window[-1] if window else float("nan")}

    def state_dict(self) -> Dict[str, Any]:
        return {"curriculum": self.curriculum.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.curriculum.load_state_dict(state["curriculum"])

    def speed_options(self, device: torch.device) -> Optional[str]:
        setting = self.method_section.fuse_attacks
        fused = resolve_fuse_attacks(setting, device)
        why = f": {'on' if fused else 'off'} for {device.type}" if setting == "auto" else ""
        return (f"attacks {'in one fused pass' if fused else 'in two passes'} "
                f"(fuse_attacks={str(setting).lower()}{why})")

    def describe(self) -> str:
        return f"DAT (T={self.curriculum.T}, max {self.curriculum.max_T})"


def global_aucs_all_ranks(runtime: Runtime, scores: Dict[str, torch.Tensor]) -> tuple:
    """(adv AUC, clean AUC or None) on the all-gathered global batch, so the curriculum does not
    depend on the number of ranks. Every rank calls this with the same set of scores."""
    columns = [scores["in"], scores["adv"]] + ([scores["out"]] if "out" in scores else [])
    gathered = all_gather_cat(runtime, torch.stack(columns, dim=1).cpu())
    adv_auc = float(binary_auc(gathered[:, 0], gathered[:, 1]))
    clean_auc = float(binary_auc(gathered[:, 0], gathered[:, 2])) if len(columns) > 2 else None
    return adv_auc, clean_auc

