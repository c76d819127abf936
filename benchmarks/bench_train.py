"""Training-speed benchmark sections (one section per process; `benchmarks/run_all.py` runs them
all and prints the table). Every figure times the functions the training loop itself calls
(`Trainer.train_step_all_ranks`, `DAT.micro_loss`, `pgd_from_config`, `dat_loss`, `Precision`, `ema.update`,
`DAT.after_step` (global AUCs + curriculum), `consensus`, `log_metrics`, `save_training_state`,
`Parts.load_state_dict`, `build_train_data`, `Evaluator.evaluate_all_ranks`) with the thread count set
explicitly.

    .venv/bin/python benchmarks/bench_train.py SECTION [--config quickstart|wrn] [--threads N]
        [--world-size W] [--reps N] [--warmup N] [--json PATH] [--set key=value ...]

Sections (the code of each is in benchmarks/sections/):
  breakdown   step time split into data wait, negative attack, classifier attack,
              forward+backward, optimizer, EMA, bookkeeping, logging/checkpoint (amortized)
  steps       the loop's step vs a minimal hand-written PyTorch DAT step (interleaved), and
              DAT.step alone
  peer        DAT.step in NCHW (the old default), the default (channels_last on CPU), with NHWC
              inputs, and compiled (interleaved), the
              step's FLOPs and the machine's GEMM rate (the peer comparison, `wrn` config)
  ddp         images/s of the loop's step on W ranks (rebm.distributed.spawn, gloo on CPU; or
              under torchrun); with W > 1 also the gradient all-reduce (exposed and raw)
  attack      one PGD step (input gradient only) vs one training forward+backward
  eval        Evaluator.evaluate_all_ranks (accuracy + robust accuracy) on the digits test set, W ranks;
              --independent: each rank evaluates all of it at once (the contention ceiling)
  resume      restore + build_train_data(start_step=k) + first batch, k = 10 vs 10,000
  checkpoint  save_training_state of the WRN-16-4 training state (training is blocked for it)
  compile     model.compile: first step of a fresh run, of a restart without and with the run
              dir's compile cache (each in a fresh process with an empty local inductor cache),
              and the graphs compiled / recompiled
  breakeven   model.compile: the first compiled step's compilation against the time a compiled
              step saves over an eager one (interleaved): after how many steps compiling pays
  sampling    images/s of the sample pass (SampleGenerator, fixed PGD steps) at 32 and 224 px
              against the attack roofline (the machine's GEMM rate / the steps' FLOPs)
  fused       the two attacks of one micro-batch separate vs fused (fuse_attacks), eager and
              compiled
  prc         precision/recall's k-NN (sharded) on 1 and 2 processes x 1 thread, 5000 + 5000
              2048-d rows (benchmarks/sections/fidelity.py)
  original    the original DAT code's step vs rebm's (eager, default, bf16), interleaved, in
              their own processes; needs REBM_ORIGINAL (benchmarks/sections/original.py)
  evalshare   seconds per image of a training step, an evaluation forward, a PGD step and an
              Inception forward (FID): the units of the evaluation wall-time share estimate

Configs: `quickstart` = experiments/quickstart/digits.yaml (WRN-10-1, 16 px, batch 64, T = 10,
K = 5); `wrn` = CIFAR-shaped WRN-16-4 (2.75M params), 32 px, 10 classes, batch 32, T = 10,
K = 10, frozen BatchNorm, float32, SGD, EMA, fake CIFAR-10 in the real on-disk format. In every
section T is fixed at attack.max_steps (the end of the curriculum, its steady state).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

import torch
from sections.attack import section_attack
from sections.breakdown import section_breakdown
from sections.common import CONFIGS, write_json
from sections.ddp import section_ddp
from sections.evaluation import section_eval
from sections.fidelity import section_prc
from sections.fused import section_fused
from sections.original import section_original
from sections.peer import section_peer
from sections.sampling import section_sampling
from sections.speed import section_breakeven, section_compile, section_evalshare
from sections.state import section_checkpoint, section_resume
from sections.steps import section_steps

SECTIONS = {
    "breakdown": section_breakdown,
    "steps": section_steps,
    "peer": section_peer,
    "ddp": section_ddp,
    "eval": section_eval,
    "attack": section_attack,
    "resume": section_resume,
    "checkpoint": section_checkpoint,
    "compile": section_compile,
    "evalshare": section_evalshare,
    "sampling": section_sampling,
    "breakeven": section_breakeven,
    "prc": section_prc,
    "fused": section_fused,
    "original": section_original,
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("section", choices=sorted(SECTIONS))
    parser.add_argument("--config", default="quickstart", choices=CONFIGS)
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process")
    parser.add_argument("--world-size", type=int, default=1,
                        help="ranks for ddp/eval (spawned here; ignored under torchrun)")
    parser.add_argument("--reps", type=int, default=3, help="measured repetitions (steps)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured repetitions first")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    parser.add_argument("--workdir", default=None, help="temporary files (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the result here (default: stdout)")
    parser.add_argument("--independent", action="store_true",
                        help="eval: every rank evaluates the whole test set by itself")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides, e.g. --set batch_size=1024")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("REBM_NO_PROGRESS", "1")
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            args.workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="rebm_bench_"))
        os.makedirs(args.workdir, exist_ok=True)
        to_stdout = args.json is None
        if to_stdout:
            args.json = os.path.join(args.workdir, f"{args.section}.json")
        result = SECTIONS[args.section](args)
        if result:
            result.setdefault("torch", torch.__version__)
            write_json(args.json, result)
            if to_stdout:
                print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
