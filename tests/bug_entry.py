"""An entry point with a bug on one rank, for tests: `python -m tests.bug_entry CONFIG
[key=value ...] --bug-on-rank R` (under torchrun like `python -m rebm.eval.evaluate`): once the
process group is up, rank R raises an uncaught ValueError; the other ranks wait for the launcher
to stop them (at most a minute)."""

from __future__ import annotations

import sys
import time
from typing import List, Optional

from rebm import cli


def fail_on_one_rank_all_ranks(_cfg, runtime, args) -> None:
    if runtime.rank == args.bug_on_rank:
        raise ValueError(f"a bug on rank {runtime.rank}")
    time.sleep(60)


def main(argv: Optional[List[str]] = None) -> int:
    parser = cli.build_parser("tests.bug_entry", __doc__.splitlines()[0])
    parser.add_argument("--bug-on-rank", type=int, default=0)
    return cli.run_entry(parser, argv, fail_on_one_rank_all_ranks)


if __name__ == "__main__":
    sys.exit(main())
