"""Per-class FID statistics for the counterfactual FID (metric "counterfactuals",
rebm/eval/metrics/counterfactuals/__init__.py):

    python -m rebm.eval.counterfactuals CONFIG --class-stats TEMPLATE [--split train|test]

writes TEMPLATE.format(label=c) (a pytorch-fid .npz) for every class c of the split
(rebm/eval/metrics/counterfactuals/stats.py); point `eval.counterfactual_fid_stats` at TEMPLATE. The work
is imported once the arguments are good, so `--help` answers at once.
"""

from __future__ import annotations

import sys
from typing import List, Optional

from rebm import cli


def main(argv: Optional[List[str]] = None) -> int:
    parser = cli.build_parser("rebm.eval.counterfactuals",
                              "Per-class FID statistics for the counterfactual FID")
    parser.add_argument("--class-stats", required=True, metavar="TEMPLATE",
                        help="the .npz files to write, a path with {label}")
    parser.add_argument("--split", choices=("train", "test"), default="train")
    parser.add_argument("--batch-size", type=int, default=100, help="images per batch")
    return cli.run_entry(parser, argv, class_stats_all_ranks)


def class_stats_all_ranks(cfg, runtime, args):
    """Every rank: the per-class statistics (rebm/eval/metrics/counterfactuals/stats.py)."""
    from rebm.eval.metrics.counterfactuals.stats import run_class_stats_all_ranks  # after --help

    return run_class_stats_all_ranks(cfg.evaluation, runtime, args)


if __name__ == "__main__":
    sys.exit(main())
