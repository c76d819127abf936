"""Robustness test of a CIFAR-10/100 checkpoint of either stage; prints one JSON line.

    python InNOutRobustnessMean0_cifar100/cifar10_robustness_test.py CONFIG model.ckpt_path=PATH
    python ... CONFIG model.ckpt_path=PATH --calibration_only      # ECE (20 bins) only
    torchrun --nproc_per_node=N InNOutRobustnessMean0_cifar100/cifar10_robustness_test.py ...

Reports clean accuracy, PGD robust accuracy with the config's `indist_attack_clf` threat model
(`robust_eval_steps=S` for more steps) and, with `--autoattack`, AutoAttack (pyautoattack,
standard version). The test set is sharded over the ranks; the numbers equal those of one process.
A thin CLI over rebm.eval.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import List, Optional

from rebm import cli


def robustness_test_all_ranks(cfg, runtime, args) -> dict:
    from rebm.distributed import print_line, setup_logging
    from rebm.eval.evaluator import Evaluator, load_eval_model
    from rebm.eval.registry import standard_metrics

    setup_logging(runtime)
    calibration_only = args.calibration_only
    names = (("ece",) if calibration_only else
             standard_metrics(cfg.evaluation, samples=False,
                              extra=["autoattack"] if args.autoattack else []))
    evaluator = Evaluator(cfg.evaluation, runtime, names).start_all_ranks()
    # EMA weights of a training state when use_ema
    model = load_eval_model(cfg.model, cfg.data, cfg.ema.use_ema, runtime)
    metrics = evaluator.evaluate_all_ranks(model).values
    if calibration_only:
        metrics.pop("n_test")
    metrics.update(ckpt_path=os.path.abspath(cfg.model.ckpt_path),
                   world_size=runtime.world_size)
    # NaN (an empty test set) is not JSON: report it as null.
    metrics = {k: None if isinstance(v, float) and math.isnan(v) else v
               for k, v in metrics.items()}
    if runtime.is_main:
        print_line(json.dumps(metrics))
    return metrics


def main(argv: Optional[List[str]] = None) -> int:
    parser = cli.build_parser("cifar10_robustness_test.py", __doc__.splitlines()[0])
    parser.add_argument("--calibration_only", action="store_true",
                        help="only the expected calibration error (20 equal-width bins)")
    parser.add_argument("--autoattack", action="store_true",
                        help="also AutoAttack accuracy (pyautoattack, standard version)")
    parser.epilog = __doc__.split("\n", 2)[2]  # usage lines (torchrun runs the script file)
    return cli.run_entry(parser, argv, robustness_test_all_ranks)


if __name__ == "__main__":
    sys.exit(main())
