"""DAT training (stage 2): `python -m rebm.training.train CONFIG [key=value ...]`.

Launch on N processes with `torchrun --nproc_per_node=N -m rebm.training.train CONFIG`. The loop
is rebm.engine.trainer (the same for stage 1); the method is rebm.methods.dat. Heavy modules are
imported when training starts, so `--help` answers at once.
"""

from __future__ import annotations

import sys
from typing import List, Optional

from rebm import cli


def run(cfg, runtime, _args) -> dict:
    from rebm.engine.trainer import train
    from rebm.methods.dat import DAT

    return train(cfg, runtime, DAT)


def loss_streams(cfg) -> int:
    """Micro-batches DAT's loss pass holds (`--check`'s memory plan)."""
    from rebm.methods.dat import DAT

    return DAT.loss_streams(cfg)


def check_dat(args, cfg) -> None:
    """DAT's own config rules; under `--check`, also what FID lacks on this machine, as
    warnings (training would stop at start)."""
    from rebm.methods.dat import DAT

    DAT.check_config(cfg)
    if args.check:
        from rebm.eval.fid import fid_problems

        for problem in fid_problems(cfg):
            print(f"warning: {problem}", file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> int:
    parser = cli.build_parser("rebm.training.train", __doc__.splitlines()[0])
    return cli.run_entry(parser, argv, run, prepare=check_dat, loss_streams=loss_streams)


if __name__ == "__main__":
    sys.exit(main())
