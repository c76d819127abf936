"""Sections `resume` (restore + build_train_data(start_step=k) + first batch, k = 10 vs 10,000)
and `checkpoint` (save_training_state of a training state; training is blocked for it)."""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, List

import torch
import torch.nn.functional as F

from rebm.checkpoint.manager import CheckpointManager
from rebm.checkpoint.run_directory import RunDirectory
from rebm.checkpoint.state import read_state, training_state
from rebm.config import to_dict
from rebm.data import build_train_data
from rebm.engine.saving import save_training_state_all_ranks
from rebm.methods.dat import DAT
from sections.common import (
    Bench,
    build,
    median,
    section_result,
    single_process,
    timed,
)

RESUME_STEPS = (10, 10_000)


def _save(bench: Bench, run_dir: str) -> None:
    """The training state of the current step into run_dir, written as the loop writes it."""
    save_training_state_all_ranks(bench.parts, _checkpoint_manager(bench, run_dir),
                                  to_dict(dataclasses.replace(bench.cfg, run_dir=run_dir)),
                                  bench.cfg.distributed, bench.runtime)


def _checkpoint_manager(bench: Bench, run_dir: str) -> CheckpointManager:
    return CheckpointManager(RunDirectory(run_dir), bench.runtime, bench.cfg.run.keep_last_states)


def _resume_once(bench: Bench, k: int, run_dir: str, path: str) -> Dict[str, float]:
    """Seconds of one resume at step k: read_state alone, then what the loop does: agree on
    the state + load it into fresh parts, and the data pipeline's first batch at step k."""
    cfg, runtime = bench.cfg, bench.runtime
    _, t_read = timed(lambda: read_state(path))
    fresh = build(cfg, runtime, load_pretrained=False)
    _, t_restore = timed(lambda: fresh.load_state_all_ranks(
        _checkpoint_manager(bench, run_dir).resume_state_all_ranks(None, allow_auto=True), runtime))
    assert fresh.progress.step == k

    def first_batch():
        return next(iter(build_train_data(cfg.inputs, runtime, bench.plan, DAT.streams,
                                          start_step=k)))

    batch, t_data = timed(first_batch)
    assert batch[0].step == k
    return {"read_state": t_read, "restore": t_restore, "data_first_batch": t_data,
            "total": t_restore + t_data}


def section_resume(args) -> dict:
    bench = single_process(args)
    paths = {}
    for k in RESUME_STEPS:  # one state per resume point, in its own run dir
        run_dir = os.path.join(args.workdir, f"resume_{args.config}_{k}")
        bench.parts.progress.step = k
        _save(bench, run_dir)
        paths[k] = (run_dir, RunDirectory(run_dir).states()[0])
    times: Dict[int, Dict[str, List[float]]] = {k: {} for k in RESUME_STEPS}
    for rep in range(args.warmup + args.reps):
        for k in (RESUME_STEPS if rep % 2 == 0 else RESUME_STEPS[::-1]):
            seconds = _resume_once(bench, k, *paths[k])
            if rep >= args.warmup:
                for name, value in seconds.items():
                    times[k].setdefault(name, []).append(value)
    med = {str(k): {name: median(v) for name, v in times[k].items()} for k in RESUME_STEPS}
    first, last = (str(k) for k in RESUME_STEPS)
    return section_result(
        "resume", args, bench, state_mib=os.path.getsize(paths[RESUME_STEPS[0]][1]) / 2**20,
        at_step=med, difference_s=med[last]["total"] - med[first]["total"])


def _one_update(bench: Bench) -> None:
    """One cheap optimizer step, so the state holds momentum buffers and an updated EMA."""
    parts, size = bench.parts, bench.cfg.data.image_size
    x = torch.rand(2, 3, size, size, device=bench.runtime.device)
    F.cross_entropy(parts.model(x), torch.zeros(2, dtype=torch.long, device=x.device)).backward()
    parts.optimizer.step()
    if parts.ema is not None:
        parts.ema.update()


def section_checkpoint(args) -> dict:
    bench = single_process(args)
    cfg, parts, runtime = bench.cfg, bench.parts, bench.runtime
    _one_update(bench)
    run_dir = os.path.join(args.workdir, f"checkpoint_{args.config}")
    assemble, blocked, reads = [], [], []
    for rep in range(args.warmup + args.reps):
        parts.progress.step = 1000 * (rep + 1)
        _, t_assemble = timed(lambda: training_state(   # what the save assembles
            parts.stateful(), parts.training_method.stage, parts.progress.step, to_dict(cfg),
            runtime.world_size))
        _, t_blocked = timed(lambda: _save(bench, run_dir))
        _, t_read = timed(lambda: read_state(RunDirectory(run_dir).states()[0]))
        if rep >= args.warmup:
            assemble.append(t_assemble)
            blocked.append(t_blocked)
            reads.append(t_read)
    size = os.path.getsize(RunDirectory(run_dir).states()[0])
    write_s = median(blocked)
    return section_result(
        "checkpoint", args, bench, state_mib=size / 2**20, dir=args.workdir,
        save_training_state_s=write_s, state_dict_assembly_s=median(assemble),
        read_state_s=median(reads), write_mib_per_s=size / 2**20 / write_s,
        training_blocked_s=write_s, every_n_steps=cfg.intervals.n_imgs_per_ckpt_save / cfg.schedule.batch_size)
