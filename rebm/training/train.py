"""DAT training (stage 2): `python -m rebm.training.train CONFIG [key=value ...]`.

Launch on N processes with `torchrun --nproc_per_node=N -m rebm.training.train CONFIG`. The loop
is rebm.engine.loop (the same for stage 1); the method is rebm.methods.dat.
"""

from __future__ import annotations

import sys
from typing import List, Optional

from torch.distributed.elastic.multiprocessing.errors import record

from rebm import cli
from rebm.engine.loop import train
from rebm.methods.dat import DAT


def run(cfg, runtime, _args) -> dict:
    return train(cfg, runtime, DAT)


@record
def main(argv: Optional[List[str]] = None) -> int:
    parser = cli.build_parser("rebm.training.train", __doc__.splitlines()[0])
    return cli.run_entry(parser, argv, run)


if __name__ == "__main__":
    sys.exit(main())
