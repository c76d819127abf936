"""Section `breakdown`: one DAT step taken apart into the calls Trainer.train_step_all_ranks makes
(data, negative attack, classifier attack, forward + backward, optimizer, EMA, bookkeeping), each
timed; the loop's metrics log, image grid and checkpoint, amortized over their intervals; and the
real loop step on the next batch, to check that the pieces add up."""

from __future__ import annotations

from typing import Dict, List

import torch

from rebm import distributed as rd
from rebm.attacks.pgd import pgd_from_config
from rebm.distributed.parallel import micro_step_sync
from rebm.engine.metrics_window import MetricsWindow, peak_memory_mib
from rebm.methods.base import MicroOutput, StepResult, mean_terms
from rebm.methods.dat import dat_loss
from sections.common import (
    Bench,
    Stopwatch,
    loop_step,
    median,
    section_result,
    single_process,
)

PIECES = ["data_wait", "neg_attack", "clf_attack", "fwd_bwd", "optimizer", "ema", "bookkeeping"]
EVENTS = {"metrics_log": "n_imgs_per_metrics_log", "image_log": "n_imgs_per_image_log",
          "checkpoint": "n_imgs_per_ckpt_save"}


def _fy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).float().gather(1, y[:, None])[:, 0]


def _micro_pieces(bench: Bench, batch, last: bool, watch: Stopwatch) -> MicroOutput:
    """One micro-batch of DAT.micro_loss and its backward, piece by piece: attacks on the module without DDP (compiled
    if it is) in eval mode, then the loss forward and backward through the wrapper."""
    cfg, parts, attacked = bench.cfg, bench.parts, bench.ctx.attacked
    training_method = parts.training_method
    precision = parts.precision
    with watch("data_wait"):
        batch = batch.to(bench.runtime.device)
    attacked.eval()
    with watch("neg_attack"), precision.autocast():
        x_adv = pgd_from_config(attacked, batch["out"].images, cfg.method.attack,
                                steps=training_method.curriculum.T,
                                y=batch["in"].labels,
                                objective="lse" if cfg.method.logsumexp_sampling else "logit",
                                random_start_keys=batch["out"].keys)
    with watch("clf_attack"), precision.autocast():
        x_c_adv = pgd_from_config(attacked, batch["clf"].images, cfg.method.indist_attack_clf, objective="ce",
                                  y=batch["clf"].labels, random_start_keys=batch["clf"].keys,
                                  ce_batch_sizes=cfg.schedule.batch_size)
    keep: Dict[str, torch.Tensor] = {"x_adv": x_adv.detach()}
    with watch("fwd_bwd"):
        if not training_method.frozen_bn:
            keep["in"], keep["adv"] = _fy(attacked, batch["in"].images, batch["in"].labels), _fy(
                attacked, x_adv, batch["in"].labels)
        parts.model.train()
        with micro_step_sync(parts.model, last=last):
            with precision.autocast():
                losses = dat_loss(parts.model, batch["in"].images, batch["in"].labels, x_adv,
                                  x_c_adv, batch["clf"].labels, batch["out"].images,
                                  training_method.loss_options)
            precision.backward(losses.loss / bench.plan.accumulation_steps)
    if training_method.frozen_bn:
        keep["in"], keep["adv"] = losses.logit_in, losses.logit_adv
    terms = {name: term.detach() for name, term in losses.terms.items()}
    return MicroOutput(loss=losses.loss.detach(), terms=terms, keep=keep)


def _pieces_step(bench: Bench, batches, watch: Stopwatch) -> StepResult:
    """next(batches), the update and Trainer.train_step_all_ranks's EMA and bookkeeping, plus
    the loop's consensus, each piece timed into `watch`."""
    parts, runtime = bench.parts, bench.runtime
    with watch("data_wait"):
        micro_batches = next(batches)
    with watch("optimizer"):
        parts.optimizer.zero_grad(set_to_none=True)
    outputs = [_micro_pieces(bench, batch, index == len(micro_batches) - 1, watch)
               for index, batch in enumerate(micro_batches)]
    with watch("optimizer"):
        applied = parts.precision.step(parts.optimizer)
    if parts.ema is not None:
        with watch("ema"):
            parts.ema.update()
    terms = mean_terms(outputs)
    result = StepResult(
        loss=sum(terms.values()), losses=terms,
        window={**{name: float(value) for name, value in terms.items()}, "n": 1.0},
        previews={"train_adv": outputs[0].keep["x_adv"]},
        scores={k: torch.cat([o.keep[k] for o in outputs]).float() for k in ("in", "adv")})
    with watch("bookkeeping"):
        parts.progress.step += 1
        # AUCs, curriculum
        result.stats = parts.training_method.after_step_all_ranks(runtime, result)
        parts.progress.window.add(result.window)
        rd.consensus(runtime, preempt=False, nonfinite=not (applied and result.finite),
                     write_failed=False)
    return result


def _events(bench: Bench, result: StepResult, tracker, rep: int, watch: Stopwatch) -> None:
    """The loop's metrics log, image grid and checkpoint, each once."""
    parts, runtime = bench.parts, bench.runtime
    with watch("metrics_log"):  # Trainer.log_all_ranks: one all-reduce, the method's summary
        totals, peaks = parts.progress.window.global_sums_all_ranks(runtime,
                                                                    peak_memory_mib(runtime))
        tracker.log_training(parts.progress.step, bench.plan.images(parts.progress.step), 0,
                             {**parts.training_method.summarize(totals), **result.stats, **peaks})
        parts.progress.window = MetricsWindow()
    with watch("image_log"):
        tracker.save_grid_all_ranks(result.previews["train_adv"], f"bench_{rep:03d}.png",
                                    parts.progress.step)
    with watch("checkpoint"):
        bench.trainer.save_all_ranks()  # the loop's own save


def _result(args, bench: Bench, med: Dict[str, float], full: List[float]) -> dict:
    cfg = bench.cfg
    intervals = {event: getattr(cfg, field) for event, field in EVENTS.items()}
    amortized = {event: med[event] * (cfg.schedule.batch_size / interval if interval else 0.0)
                 for event, interval in intervals.items()}
    per_step_s = {k: med.get(k, 0.0) for k in PIECES}
    per_step_s["logging_checkpoint_amortized"] = sum(amortized.values())
    return section_result(
        "breakdown", args, bench, T=bench.parts.training_method.curriculum.T,
        K=cfg.method.indist_attack_clf.max_steps, per_step_s=per_step_s,
        per_event_s={k: med[k] for k in EVENTS}, intervals_imgs=intervals,
        amortized_s=amortized, sum_of_pieces_s=sum(per_step_s.values()),
        full_loop_step_s=median(full))


def section_breakdown(args) -> dict:
    bench = single_process(args)
    tracker = bench.trainer.tracker
    batches = iter(bench.trainer.data)
    pieces: Dict[str, List[float]] = {}
    full: List[float] = []
    for rep in range(args.warmup + args.reps):
        watch = Stopwatch(bench.runtime.device)
        result = _pieces_step(bench, batches, watch)
        _events(bench, result, tracker, rep, watch)  # amortized over their intervals below
        # The real loop step on the next batch, for the sum-of-pieces check.
        with watch("data_wait_full"):
            micro_batches = next(batches)
        step_times = loop_step(bench, micro_batches)
        if rep >= args.warmup:
            for key, value in watch.times.items():
                pieces.setdefault(key, []).append(value)
            full.append(step_times["total"] + watch.times["data_wait_full"])
    tracker.close_all_ranks()
    return _result(args, bench, {k: median(v) for k, v in pieces.items()}, full)
