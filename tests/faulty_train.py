"""DAT training with an injected fault, for tests: `python -m tests.faulty_train CONFIG
[key=value ...] [--nan-grad-at STEP:RANK] [--slow-step-at STEP:RANK:SECONDS]` (under torchrun
like `python -m rebm.training.train`)."""

from __future__ import annotations

import sys
from typing import List, Optional

from rebm import cli
from rebm.training import train as dat_entry


def train_faulty_dat_all_ranks(cfg, runtime, args) -> dict:
    from rebm.engine.trainer import train
    from tests.faults import FaultyDAT, parse_fault

    nan_at, slow_at = parse_fault(args.nan_grad_at, 2), parse_fault(args.slow_step_at, 3)
    return train(cfg, runtime, lambda config: FaultyDAT(
        config.method, config.model, config.schedule, nan_at=nan_at, slow_at=slow_at))


def main(argv: Optional[List[str]] = None) -> int:
    parser = cli.build_parser("tests.faulty_train", __doc__.splitlines()[0])
    parser.add_argument("--nan-grad-at", help="STEP:RANK: NaN gradients at that step, rank")
    parser.add_argument("--slow-step-at", help="STEP:RANK:SECONDS: that step sleeps first")
    return cli.run_entry(parser, argv, train_faulty_dat_all_ranks, prepare=dat_entry.check_dat,
                         method_class=dat_entry.method_class)


if __name__ == "__main__":
    sys.exit(main())
