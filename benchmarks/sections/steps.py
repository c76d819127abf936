"""Section `steps`: the loop's step (Trainer.train_step_all_ranks + consensus) against a minimal
hand-written PyTorch DAT step on the same batches, interleaved (the framework overhead), and the
update alone (rebm.engine.step.update_all_ranks: DAT's losses, backward, optimizer step)."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from rebm.config import TrainConfig
from rebm.methods.dat import energy_bce_weights
from sections.common import (
    loop_step,
    median,
    prefetch,
    section_result,
    single_process,
    timed,
)


class MinimalDAT:
    """The same DAT math written directly in PyTorch, without rebm: two PGD loops, one fused
    forward, BCE + CE, backward, optimizer step (the config's SGD/Adam/AdamW), EMA of the
    weights. Only for the configurations the benchmark uses (L2 attacks, no random start,
    logsumexp energy, frozen BatchNorm, default loss weights, r1reg = 0)."""

    def __init__(self, raw_model: torch.nn.Module, cfg: TrainConfig):
        for name in ("attack", "indist_attack_clf"):
            attack = getattr(cfg, name)
            assert attack.norm == "L2" and not attack.random_start, name
        assert cfg.method.logsumexp and not cfg.method.logsumexp_sampling and cfg.method.r1reg == 0
        assert not cfg.model.use_batchnorm
        assert energy_bce_weights(cfg.method) == (0.5, 0.0, 0.5)
        self.cfg = cfg
        self.model = copy.deepcopy(raw_model)
        params, name = self.model.parameters(), cfg.optimization.name.lower()
        if name == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=cfg.optimization.lr, momentum=0.9, nesterov=True,
                                             weight_decay=cfg.optimization.wd)
        elif name == "adam":
            self.optimizer = torch.optim.Adam(params, lr=cfg.optimization.lr, betas=(0.0, 0.99),
                                              weight_decay=cfg.optimization.wd)
        else:
            self.optimizer = torch.optim.AdamW(params, lr=cfg.optimization.lr, betas=(0.9, 0.95),
                                               weight_decay=cfg.optimization.wd)
        self.params = [p for p in self.model.parameters()]
        self.ema = [p.detach().clone() for p in self.params]

    def pgd(self, x, y, steps: int, step_size: float, eps: float, ce: bool):
        x0 = x.detach()
        x_adv = x0
        for _ in range(steps):
            x_adv = x_adv.detach().requires_grad_(True)
            with torch.enable_grad():
                logits = self.model(x_adv)
                if ce:
                    loss = F.cross_entropy(logits, y, reduction="sum")
                else:
                    loss = logits.gather(1, y[:, None]).sum()
                (grad,) = torch.autograd.grad(loss, x_adv)
            norm = grad.flatten(1).norm(dim=1).clamp_min(1e-12).view(-1, 1, 1, 1)
            x_adv = x_adv.detach() + grad * (step_size / norm)
            if not math.isinf(eps):
                delta = x_adv - x0
                scale = eps / delta.flatten(1).norm(dim=1).clamp_min(eps).view(-1, 1, 1, 1)
                x_adv = x0 + delta * scale
            x_adv = x_adv.clamp(0.0, 1.0)
        return x_adv.detach()

    def step(self, batch, T: int) -> float:
        cfg, model = self.cfg, self.model
        model.eval()
        a, c = cfg.method.attack, cfg.method.indist_attack_clf
        x_adv = self.pgd(batch["out"].images, batch["in"].labels, T, a.step_size, a.eps, ce=False)
        x_c = self.pgd(batch["clf"].images, batch["clf"].labels, c.max_steps, c.step_size, c.eps, ce=True)
        model.train()
        b = batch["in"].images.shape[0]
        logits = model(torch.cat([batch["in"].images, x_adv, x_c]))
        energy = torch.logsumexp(logits[: 2 * b], dim=1)
        target = torch.cat([torch.ones(b), torch.zeros(b)]).to(energy)
        loss = (F.binary_cross_entropy_with_logits(energy, target)
                + F.cross_entropy(logits[2 * b:], batch["clf"].labels))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_lerp_(self.ema, self.params, 1.0 - cfg.ema.ema_decay)
        return float(loss.detach())


def section_steps(args) -> dict:
    bench = single_process(args)
    cfg, parts, device = bench.cfg, bench.parts, bench.runtime.device
    assert bench.plan.accumulation_steps == 1
    minimal = MinimalDAT(parts.raw_model, cfg)
    n = args.warmup + args.reps
    prefetched = prefetch(bench, n)
    T = parts.training_method.curriculum.T
    loop_t, dat_t, min_t = [], [], []
    for rep in range(n):
        batch = prefetched[rep]
        order = ("loop", "minimal") if rep % 2 == 0 else ("minimal", "loop")
        for which in order:
            if which == "loop":
                times = loop_step(bench, batch)
            else:
                _, seconds = timed(lambda b=batch: minimal.step(b[0], T), device)
        if rep >= args.warmup:
            loop_t.append(times["total"])
            dat_t.append(times["dat_step"])
            min_t.append(seconds)
    paired = [a / b for a, b in zip(loop_t, min_t, strict=True)]
    return section_result(
        "steps", args, bench, T=T, K=cfg.method.indist_attack_clf.max_steps,
        image_size=cfg.data.image_size, model=cfg.model.model_type,
        dat_step_s=median(dat_t), dat_step_all_s=dat_t,
        loop_step_s=median(loop_t), minimal_step_s=median(min_t),
        overhead_ratio=median(loop_t) / median(min_t), overhead_ratio_paired=median(paired))
