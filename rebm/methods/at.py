"""Adversarial training, the method of stage 1 (In-N-Out style, live BatchNorm).

Loss per step: CE(f(PGD_K^CE(x_c)), y_c) with the `indist_attack_clf` threat model, on the one
stream it declares: the in-distribution images with the classification augmentation. The learning rate
follows a cosine to 0 over the run (the In-N-Out recipe) or stays constant.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from rebm.attacks.argmin_pgd import attack_from_config
from rebm.config import ConfigError, ModelConfig
from rebm.config.origins import BUILT_IN_CODE, ConfigOrigins
from rebm.config.sections import MethodSection, ScheduleSection
from rebm.data import CLASSIFIER, MicroBatch
from rebm.methods.base import Method, MicroOutput, StepContext, StepResult, mean_terms
from rebm.methods.stages import STAGE1

LOGGER = logging.getLogger("rebm")
SCHEDULES = STAGE1.schedules


def lr_factor(schedule: str, last_step: int) -> Callable[[int], float]:
    """Cosine to 0 over the run, or constant."""
    if schedule == "constant":
        return lambda step: 1.0
    return lambda step: 0.5 * (1.0 + math.cos(math.pi * min(step, last_step) / last_step))


class AdversarialTraining(Method):
    name = "adversarial training"
    stage = STAGE1.number
    streams = (CLASSIFIER,)  # the loss pass holds this one micro-batch
    log_final_step = True
    # model_bestacc.pth: the evaluated model (the EMA one with use_ema) of the best robust test
    # accuracy, In-N-Out's best_avg.pth (its test() keeps the EMA model of the best adversarial
    # test accuracy under the training attack, train_types/in_distribution_training.py:58, :114)
    keep_best = True

    def __init__(self, method: MethodSection, model: ModelConfig, schedule: ScheduleSection):
        super().__init__(method, model, schedule)
        self.method_section = method
        self.global_batch_size = schedule.batch_size  # In-N-Out's attacked batch (micro_loss)
        self.lr_schedule = STAGE1.lr_schedule(schedule)  # its name
        self.last_step: Optional[int] = None

    @classmethod
    def check_config(cls, method: MethodSection, model: ModelConfig, schedule: ScheduleSection,
                     origins: ConfigOrigins = BUILT_IN_CODE) -> None:
        STAGE1.check(schedule, model, origins)  # live BatchNorm, a schedule stage 1 offers

    def lr_scheduler(self, optimizer: torch.optim.Optimizer, last_step: float):
        if math.isinf(last_step):
            raise ConfigError("set total_epochs or max_steps (the LR schedule needs a length)")
        self.last_step = int(last_step)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(self.lr_schedule, last_step))

    def micro_loss(self, ctx: StepContext, batch: MicroBatch, index: int, log_now: bool
                   ) -> MicroOutput:
        clf = batch[CLASSIFIER.name]
        # Attack in eval mode, without DDP: BN uses its running statistics, so the K attack
        # forwards neither update them nor run SyncBatchNorm/DDP collectives, and the
        # adversarial example does not depend on how the batch is split over ranks.
        # The CE is In-N-Out's mean over its whole batch of `bs` = batch_size (DataParallel
        # gathers the logits), whatever rebm's ranks and micro-batches.
        ctx.attacked.eval()
        with ctx.autocast():
            x_adv = attack_from_config(ctx.attacked, clf.images, self.method_section.indist_attack_clf,
                                       objective="ce", y=clf.labels, random_start_keys=clf.keys,
                                       ce_batch_sizes=self.global_batch_size)
        # The training forward is in train mode through DDP: BN normalises with (synced, on
        # GPU) batch statistics of the adversarial batch and updates its running stats.
        ctx.model.train()
        with ctx.autocast():
            logits = ctx.model(x_adv)
            loss = F.cross_entropy(logits.float(), clf.labels)
        correct = (logits.argmax(1) == clf.labels).sum()
        return MicroOutput(loss=loss, terms={"clf": loss.detach()},
                           keep={"correct": correct.detach()})

    def step_result(self, outputs: List[MicroOutput], micro_batches: List[MicroBatch]
                    ) -> StepResult:
        terms = mean_terms(outputs)
        sizes = [len(b[CLASSIFIER.name].labels) for b in micro_batches]
        window = {"clf_sum": sum(float(o.terms["clf"]) * n
                                 for o, n in zip(outputs, sizes, strict=True)),
                  "correct": sum(float(o.keep["correct"]) for o in outputs),
                  "images": float(sum(sizes))}
        return StepResult(loss=terms["clf"], losses=terms, window=window)

    def summarize(self, totals: Dict[str, float]) -> Dict[str, float]:
        return {"train_clf_loss": totals["clf_sum"] / totals["images"],
                "train_adv_acc": totals["correct"] / totals["images"]}

    def state_dict(self) -> Dict[str, Any]:
        return {"schedule": self.lr_schedule, "last_step": self.last_step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if (state.get("schedule"), state.get("last_step")) != (self.lr_schedule, self.last_step):
            LOGGER.warning("the LR schedule changes on resume: %s over %s steps before, %s over "
                           "%s steps now", state.get("schedule"), state.get("last_step"),
                           self.lr_schedule, self.last_step)

    def describe(self) -> str:
        return f"stage 1: adversarial training, {self.lr_schedule} LR over {self.last_step} steps"
