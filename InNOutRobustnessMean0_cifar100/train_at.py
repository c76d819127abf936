"""Stage 1: adversarial training with live BatchNorm (In-N-Out style, mean-0 fill augmentation).

    torchrun --nproc_per_node=N InNOutRobustnessMean0_cifar100/train_at.py [CONFIG] [key=value ...]
    python InNOutRobustnessMean0_cifar100/train_at.py [CONFIG] --nproc N [key=value ...]

Loss per step: CE(f(PGD_K^CE(x_c)), y_c) with the `indist_attack_clf` threat model, on the
classification stream of rebm's data pipeline (its other streams are ignored). CONFIG defaults to
configs/cifar100_wrn34x10.yaml (`--dataset cifar10`: configs/cifar10_wrn34x10.yaml). Writes
<run_dir>/model_final.pth (EMA weights when use_ema), a DAT run's `model.ckpt_path`. Training
states go to <run_dir>/checkpoints/; the same command resumes from the newest (as in stage 2).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

from rebm import distributed as dist_utils
from rebm.attacks.pgd import pgd_from_config
from rebm.eval.evaluate import evaluate_model
from rebm.training import cli
from rebm.training.checkpoint_io import save_model
from rebm.training.config_classes import ConfigError, load_config, plan_batches
from rebm.training.data import build_train_data
from rebm.training.ema import build_ema
from rebm.training.modeling import get_model, get_optimizer, strip_parallel
from rebm.training.state import (
    StateError,
    load_training_state,
    replicas_identical,
    save_on_main,
    training_state,
)
from rebm.training.step import Precision
from rebm.training.tracking import Tracker, resolve_run_dir
from rebm.training.train import TrainingDiverged, crossed, planned_last_step, resume_state

LOGGER = logging.getLogger("rebm")
HERE = os.path.dirname(os.path.abspath(__file__))
DATASETS = {"cifar100": 100, "cifar10": 10}


def lr_factor(schedule: str, last_step: int):
    """Cosine to 0 over the run (the In-N-Out recipe), or constant."""
    if schedule == "constant":
        return lambda step: 1.0
    return lambda step: 0.5 * (1.0 + math.cos(math.pi * min(step, last_step) / last_step))


def train(cfg, runtime, schedule: str) -> None:
    plan = plan_batches(cfg, runtime.world_size)
    run_dir = resolve_run_dir(cfg, runtime)
    dist_utils.setup_logging(runtime, run_dir)
    if cfg.per_device_eval_batch_size is None:
        # Stage 1's loss pass holds one micro-batch (DAT's holds three, which rebm's default
        # evaluation batch assumes): evaluate in micro-batches, so evaluation fits wherever
        # training does.
        cfg.per_device_eval_batch_size = plan.per_device_batch_size
    # The state to resume from (rank 0 decides, every rank loads it): it holds the weights, so
    # model.ckpt_path is then not read; the data position is the step, so the loader starts
    # there directly.
    state = resume_state(cfg, runtime, run_dir)
    torch.manual_seed(cfg.rand_seed)  # same initial weights on every rank
    # DDP + SyncBatchNorm (GPU, cfg.sync_batchnorm) here
    model, raw = get_model(cfg, runtime, load_pretrained=state is None)
    attacked = strip_parallel(model)  # no DDP; compiled when model.compile is set
    syncbn = any(isinstance(m, torch.nn.SyncBatchNorm) for m in raw.modules())
    optimizer = get_optimizer(cfg, raw.parameters())
    ema = build_ema(raw, cfg)
    precision = Precision.from_config(cfg, runtime.device)
    start_step = int(state["step"]) if state else 0
    data = build_train_data(cfg, runtime, plan, start_step=start_step)
    last_step = planned_last_step(cfg, data.steps_per_epoch)
    if math.isinf(last_step):
        raise ConfigError("set total_epochs or max_steps (the LR schedule needs a length)")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(schedule, last_step))
    window = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, images since last log
    tracker = Tracker(cfg, runtime, run_dir,
                      wandb_run_id=state.get("wandb_run_id") if state else None)
    tracker.truncate_metrics_after(start_step)  # records of an attempt that saved no state
    if state:
        load_training_state(state, 1, raw, optimizer, ema, precision)
        scheduler.load_state_dict(state["scheduler"])
        if (state.get("schedule"), state.get("last_step")) != (schedule, last_step):
            LOGGER.warning("the LR schedule changes on resume: %s over %s steps before, %s over "
                           "%d steps now", state.get("schedule"), state.get("last_step"),
                           schedule, last_step)
        if runtime.is_main:  # the saved window is global: rank 0 carries it
            window += torch.tensor(state["metrics_window"], dtype=torch.float64)
        if not replicas_identical(runtime, raw, *([ema] if ema is not None else [])):
            raise StateError(f"after loading '{state['_path']}' the ranks' weights differ")
        LOGGER.info("resumed from %s at step %d", state["_path"], start_step)
    LOGGER.info("stage 1 | run dir %s | world size %d | %s | %d steps, %s LR", run_dir,
                runtime.world_size, runtime.device, last_step, schedule)

    def log(step: int, metrics: dict) -> None:  # rank 0 writes metrics.jsonl and prints JSON
        tracker.log(step, step * cfg.batch_size, data.epoch_of(step - 1), metrics)
        if runtime.is_main:
            dist_utils.print_line(json.dumps({"step": step, **metrics}))

    def evaluate(step: int) -> None:  # every rank evaluates its shard (collectives inside)
        eval_model = ema.ema_model if ema is not None else raw
        log(step, evaluate_model(eval_model, cfg, runtime, step=step, samples=False))

    def save(step: int) -> None:  # every rank: the window all-reduce and the write consensus
        global_window = dist_utils.all_reduce_sum(runtime, window).tolist()
        save_on_main(runtime, lambda: training_state(
            1, step, raw, optimizer, ema, precision, cfg, runtime.world_size,
            tracker.wandb_run_id, scheduler=scheduler.state_dict(), schedule=schedule,
            last_step=last_step, metrics_window=global_window), run_dir, cfg.keep_last_states)

    preemption = dist_utils.PreemptionFlag().install()
    timer = time.perf_counter()
    batches = iter(data)
    for step in range(start_step + 1, last_step + 1):
        optimizer.zero_grad(set_to_none=True)
        micro_batches = next(batches)
        for index, batch in enumerate(micro_batches):
            # stage 1 trains on the classifier stream only; pinned by the loader on CUDA
            x = batch.x_c.to(runtime.device, non_blocking=True)
            y = batch.y_c.to(runtime.device, non_blocking=True)
            # Attack in eval mode, without DDP: BN uses its running statistics, so
            # the K attack forwards neither update them nor run SyncBatchNorm/DDP collectives,
            # and the adversarial example does not depend on how the batch is split over ranks.
            attacked.eval()
            with precision.autocast():
                x_adv = pgd_from_config(attacked, x, cfg.indist_attack_clf, objective="ce", y=y,
                                        random_start_keys=batch.key_c)
            # The training forward is in train mode through DDP: BN normalises with (synced,
            # on GPU) batch statistics of the adversarial batch and updates its running stats.
            model.train()
            last = index == len(micro_batches) - 1
            no_sync = getattr(model, "no_sync", None)
            with contextlib.nullcontext() if last or no_sync is None else no_sync():
                with precision.autocast():
                    logits = model(x_adv)
                    loss = F.cross_entropy(logits.float(), y)
                precision.backward(loss / plan.accumulation_steps)
            correct = float((logits.argmax(1) == y).sum())
            window += torch.tensor([float(loss.detach()) * len(y), correct, len(y)],
                                   dtype=torch.float64)
        lr = optimizer.param_groups[0]["lr"]  # the LR this step used
        precision.step(optimizer)
        scheduler.step()
        if not syncbn:  # per-rank BatchNorm statistics: keep the replicas (and EMA) identical
            dist_utils.broadcast_buffers(runtime, raw)
        if ema is not None:
            ema.update()
        # One all-reduce: every rank stops on a non-finite loss, or on a preemption signal that
        # reached any one rank, at the same step.
        nonfinite = not math.isfinite(float(window[0]))  # NaN stays in the window until logged
        decision = dist_utils.consensus(runtime, nonfinite=nonfinite, preempt=preemption.raised)
        if decision["nonfinite"]:
            raise TrainingDiverged(f"non-finite loss at step {step} (try a lower lr)")
        if crossed(cfg.n_imgs_per_metrics_log, step, cfg.batch_size) or step == last_step:
            loss_sum, correct, n = dist_utils.all_reduce_sum(runtime, window).tolist()
            elapsed, timer = time.perf_counter() - timer, time.perf_counter()
            log(step, {"train_clf_loss": loss_sum / n, "train_adv_acc": correct / n,
                       "learning_rate": lr, "imgs_per_s": n / max(elapsed, 1e-9)})
            window.zero_()
        if crossed(cfg.n_imgs_per_evaluation_log, step, cfg.batch_size):
            evaluate(step)
        if decision["preempt"] and step < last_step:  # at the last step: just finish
            save(step)
            LOGGER.warning("preempted (%s on some rank): state saved at step %d; run the same "
                           "command with run_dir=%s to resume",
                           preemption.signal_name or "signal", step, run_dir)
            tracker.close()
            return
        if crossed(cfg.n_imgs_per_ckpt_save, step, cfg.batch_size) and step < last_step:
            save(step)
    if start_step >= last_step:  # rerun of a finished run: its files exist already
        LOGGER.info("nothing to do: the run is already at step %d (raise max_steps or "
                    "total_epochs to continue it)", start_step)
        tracker.close()
        return
    if cfg.n_imgs_per_evaluation_log and not crossed(cfg.n_imgs_per_evaluation_log, last_step,
                                                     cfg.batch_size):
        evaluate(last_step)
    # model_final first: once the final state exists, a rerun has nothing left to do
    if runtime.is_main:  # plain state dict: loads as model.ckpt_path of a DAT run
        save_model(ema.ema_model if ema is not None else raw,
                   os.path.join(run_dir, "model_final.pth"))
        LOGGER.info("wrote %s", os.path.join(run_dir, "model_final.pth"))
    save(last_step)  # the same command with a larger max_steps / total_epochs continues it
    tracker.close()


def worker(config: str, overrides: List[str], schedule: str) -> None:
    """One process (torchrun, spawn or plain python): its rank comes from the environment."""
    with cli.user_errors_exit():
        cfg = load_config(config, overrides)
        runtime = dist_utils.setup_distributed(use_ddp=cfg.use_ddp, backend=cfg.ddp_backend,
                                               device=cfg.device, timeout_s=cfg.ddp_timeout_s)
        try:
            train(cfg, runtime, schedule)
        finally:
            dist_utils.teardown(runtime)


def parse(argv: Optional[List[str]]):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n", 2)[2])
    parser.add_argument("config", nargs="?", help="rebm YAML config (default: see --dataset)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. lr=0.05")
    parser.add_argument("--dataset", choices=tuple(DATASETS),
                        help="without CONFIG: its bundled config; with CONFIG: overrides "
                             "data.indist_dataset and data.num_classes (default cifar100)")
    parser.add_argument("--nproc", type=int, default=1,
                        help="start N processes with torch.multiprocessing.spawn (no torchrun)")
    parser.add_argument("--schedule", choices=("cosine", "constant"), default="cosine",
                        help="learning-rate schedule over the run (default cosine)")
    parser.add_argument("--check", action="store_true", help="validate the config and exit")
    args = parser.parse_intermixed_args(argv)
    if args.config and "=" in args.config and not os.path.isfile(args.config):
        args.overrides.insert(0, args.config)  # only overrides were given
        args.config = None
    if args.config is None:
        name = f"{args.dataset or 'cifar100'}_wrn34x10.yaml"
        args.config = os.path.join(HERE, "configs", name)
    elif args.dataset:
        args.overrides[:0] = [f"data.indist_dataset={args.dataset}",
                              f"data.num_classes={DATASETS[args.dataset]}"]
    return args


@record
def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    with cli.user_errors_exit():
        cfg = load_config(args.config, args.overrides)  # fail here, once, not in N children
        if not cfg.model.use_batchnorm:
            raise ConfigError("stage 1 trains BatchNorm live: set model.use_batchnorm=true")
        if args.check:
            return cli.check_config(cfg)
        if args.nproc > 1 and "WORLD_SIZE" in os.environ:
            raise ConfigError("--nproc starts its own processes: do not combine it with torchrun")
        plan_batches(cfg, max(args.nproc, int(os.environ.get("WORLD_SIZE", "1"))))
    dist_utils.spawn(worker, args.nproc, args.config, args.overrides, args.schedule)
    return 0


if __name__ == "__main__":
    sys.exit(main())
