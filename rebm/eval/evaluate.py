"""Evaluate a checkpoint: `python -m rebm.eval.evaluate CONFIG model.ckpt_path=PATH [key=value ...]`.

Runs as one process or under torchrun (`torchrun --nproc_per_node=N -m rebm.eval.evaluate ...`);
the test set is sharded over the ranks and the numbers are those of a single process
(rebm.eval.evaluation). Rank 0 prints the metrics as one JSON object on the last stdout line and
writes them to <run_dir>/eval.json, where run_dir is `run_dir` if set, else the checkpoint's
folder; the log says where. Heavy modules are imported once the arguments are good, so `--help`
answers at once.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List, Optional

from rebm import cli


def run(cfg, runtime, args) -> Dict[str, Any]:
    from rebm.checkpoint.paths import with_model_file
    from rebm.distributed import broadcast_object, print_line, setup_logging
    from rebm.distributed.collectives import on_main
    from rebm.eval.evaluation import LOGGER, evaluate_model, load_eval_model
    from rebm.eval.fid import require_fid_ready
    from rebm.eval.report import describe_evaluation, jsonable

    setup_logging(runtime)
    cfg = with_model_file(cfg)  # model.ckpt_path=RUN_DIR: its model_final.pth
    if args.samples:
        require_fid_ready(cfg)  # before any work: a missing weights/statistics file is one line
    model = load_eval_model(cfg, runtime)
    run_dir = cfg.run_dir or os.path.dirname(os.path.abspath(cfg.model.ckpt_path))
    run_dir = broadcast_object(runtime, run_dir)  # one folder for all ranks
    metrics = evaluate_model(model, cfg, runtime, run_dir=run_dir, samples=args.samples,
                             ece=not args.no_ece, ood=args.ood, autoattack=args.autoattack)
    metrics = {k: jsonable(v) for k, v in {**metrics, "world_size": runtime.world_size,
                                           "ckpt_path": os.path.abspath(cfg.model.ckpt_path)}.items()}

    def write() -> None:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "eval.json"), "w") as fh:
            json.dump(metrics, fh, indent=2)
        LOGGER.info("%s", describe_evaluation(metrics))
        LOGGER.info("metrics written to %s", os.path.join(run_dir, "eval.json"))
        sys.stderr.flush()
        print_line(json.dumps(metrics))  # the last stdout line, for scripts

    on_main(runtime, write, f"write {os.path.join(run_dir, 'eval.json')}")
    return metrics


def build_parser():
    parser = cli.build_parser("rebm.eval.evaluate", __doc__.splitlines()[0],
                              example="model.ckpt_path=runs/x/model_final.pth run_dir=out")
    parser.add_argument("--samples", action="store_true",
                        help="generate class-conditional samples (saved to <run_dir>/samples; "
                             "FID when image_log.log_fid)")
    parser.add_argument("--no-ece", action="store_true", help="skip the calibration error")
    parser.add_argument("--ood", action="store_true",
                        help="OOD-detection AUROC against data.outdist_dataset")
    parser.add_argument("--autoattack", action="store_true",
                        help="also AutoAttack accuracy (needs the torchattacks package)")
    return parser


def check_fid(args, cfg) -> None:
    """`--check --samples`: what FID lacks here, as warnings (the run itself would stop)."""
    if args.check and args.samples:
        from rebm.eval.fid import fid_problems

        for problem in fid_problems(cfg):
            print(f"warning: {problem}", file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> int:
    return cli.run_entry(build_parser(), argv, run, prepare=check_fid)


if __name__ == "__main__":
    sys.exit(main())
