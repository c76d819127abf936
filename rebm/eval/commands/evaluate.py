"""Evaluate a checkpoint: `python -m rebm.eval.evaluate CONFIG model.ckpt_path=PATH [key=value ...]`.

Runs as one process or under torchrun (`torchrun --nproc_per_node=N -m rebm.eval.evaluate ...`);
the test set and the samples are sharded over the ranks and the numbers are those of a single
process (rebm.eval.evaluator). The flags choose the metrics of the Evaluator. Rank 0 logs a table
of the values with what each was computed on, prints the metrics as one JSON object on the last
stdout line and writes them to <run_dir>/eval.json (with "settings": each metric's settings;
an infinite value, e.g. a radius `.inf`, as the string "inf"), where run_dir is `run_dir` if
set, else the checkpoint's folder (a training run's own folder); the log says where, before the
evaluation starts. The evaluation owns that folder while it runs (rank 0 holds `.eval.lock`
there: a second evaluation into it stops with one line), and every file it writes there goes
through a temporary file and a rename (rebm/eval/files.py), so a failed write keeps the previous
file. Heavy modules are imported once the arguments are good, so `--help` answers
at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

from rebm import cli


def evaluation_metrics(evaluation, args) -> Tuple[str, ...]:
    """The metrics of the command line: clean and robust accuracy, the calibration error unless
    --no-ece, the sample metrics with --samples, --ood, --autoattack, then eval.metrics and
    --metrics (registry names)."""
    from rebm.eval.registry import standard_metrics

    extra = [name for name, on in (("ece", not args.no_ece), ("ood", args.ood),
                                   ("autoattack", args.autoattack)) if on]
    return standard_metrics(evaluation, args.samples, [*extra, *args.metrics])


def fid_not_asked_notice(image_log, samples: bool, names) -> str:
    """One line when reference statistics are given for the samples but FID is not among the
    metrics (image_log.log_fid off): the key that turns it on. Empty when nothing is skipped."""
    if samples and image_log.data_dir and not image_log.log_fid and "fid" not in names:
        return (f"FID not computed: image_log.data_dir={image_log.data_dir} is given but "
                "image_log.log_fid is false; add image_log.log_fid=true to compute it")
    return ""


STOP_NOTICE = "stopping at the next batch, then exiting (interrupt again to stop at once)"


def evaluate_command_all_ranks(cfg, runtime, args) -> Dict[str, Any]:
    """Every rank: evaluate, then rank 0 writes eval.json. A Ctrl-C or SIGTERM stops every rank
    at the next batch with one line (nothing is written: eval.json holds complete results)."""
    from rebm.cli import start_up_timeout_advice
    from rebm.distributed.collectives import name_missing_ranks
    from rebm.distributed.signals import Preempted, exit_stopped, stop_on_signal

    advice = start_up_timeout_advice(cfg.distributed)
    with stop_on_signal(runtime, STOP_NOTICE) as runtime:
        try:
            with name_missing_ranks(runtime, lambda: "in the evaluation", advice):
                return evaluate_all_ranks(cfg.evaluation, cfg.model, cfg.run.run_dir, runtime,
                                          args)
        except Preempted:
            exit_stopped(runtime, "the evaluation did not finish, so no eval.json was written; "
                         "run the same command to evaluate again")
            raise  # not reached: exit_stopped exits


def evaluate_all_ranks(evaluation, model, run_dir: Optional[str], runtime, args
                       ) -> Dict[str, Any]:
    """Evaluate the checkpoint of `model` (the model section) on the metrics of `args`;
    eval.json goes to `run_dir`, by default the checkpoint's folder."""
    from rebm.checkpoint.paths import model_file
    from rebm.checkpoint.run_directory import RunDirectory
    from rebm.distributed import broadcast_object, print_line, setup_logging
    from rebm.distributed.collectives import decide_on_main, on_main
    from rebm.eval.evaluator import LOGGER, Evaluator, load_eval_model
    from rebm.eval.files import OutputFolderLock, write_text_replacing
    from rebm.eval.results import describe_evaluation, evaluation_table, jsonable

    setup_logging(runtime)
    names = evaluation_metrics(evaluation, args)
    notice = fid_not_asked_notice(evaluation.image_log, args.samples, names)
    if notice:
        LOGGER.info(notice)
    evaluator = Evaluator(evaluation, runtime, names)
    evaluator.start_all_ranks()  # before any other work: a missing file is one line
    if model.ckpt_path:  # model.ckpt_path=RUN_DIR: its model_final.pth
        model = dataclasses.replace(model, ckpt_path=model_file(model.ckpt_path))
    network = load_eval_model(model, evaluation.data, evaluation.ema.use_ema, runtime)
    folder = run_dir or os.path.dirname(os.path.abspath(model.ckpt_path))
    evaluator.run_dir = broadcast_object(runtime, folder)  # one folder for all ranks
    held: List[OutputFolderLock] = []  # rank 0's: no other evaluation writes into the folder
    decide_on_main(runtime, lambda: held.append(OutputFolderLock(evaluator.run_dir)),
                   f"lock the output folder {evaluator.run_dir}")
    LOGGER.info("%s", output_notice(evaluator.run_dir, chosen=run_dir is not None))
    found = evaluator.evaluate_all_ranks(network)
    values, settings = found.values, found.settings
    table = evaluation_table(values, settings)
    metrics = {k: jsonable(v) for k, v in {**values, "world_size": runtime.world_size,
                                           "ckpt_path": os.path.abspath(model.ckpt_path)}.items()}
    metrics["settings"] = jsonable(settings)  # what each value was computed on, by metric
    path = RunDirectory(evaluator.run_dir).eval_results

    def write() -> None:  # through a temporary file: a failed write keeps the previous one
        write_text_replacing(path, json.dumps(metrics, indent=2))
        LOGGER.info("%s", describe_evaluation(values))
        LOGGER.info("evaluation of %s:\n%s", model.ckpt_path, table)
        LOGGER.info("metrics written to %s", path)
        sys.stderr.flush()
        print_line(json.dumps(metrics))  # the last stdout line, for scripts

    on_main(runtime, write, f"write {path}")
    for lock in held:
        lock.release()
    return metrics


def output_notice(run_dir: str, chosen: bool) -> str:
    """Where eval.json goes, said before the evaluation: by default the checkpoint's folder,
    which for a training run is its run directory, next to training's own files."""
    from rebm.checkpoint.run_directory import RunDirectory

    path = RunDirectory(run_dir).eval_results
    replacing = ", replacing the one there" if os.path.exists(path) else ""
    if chosen:
        return f"eval.json will be written to {path}{replacing}"
    return (f"eval.json will be written to {path}, the checkpoint's folder{replacing} "
            "(run_dir=PATH writes it elsewhere)")


def metric_list(text: str) -> List[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def build_parser():
    parser = cli.build_parser("rebm.eval.evaluate", __doc__.splitlines()[0],
                              example="model.ckpt_path=runs/x/model_final.pth run_dir=out")
    parser.add_argument("--samples", action="store_true",
                        help="generate class-conditional samples (grid in <run_dir>/samples; "
                             "FID when image_log.log_fid; every sample with keep_samples)")
    parser.add_argument("--no-ece", action="store_true", help="skip the calibration error")
    parser.add_argument("--ood", action="store_true",
                        help="OOD-detection AUROC against data.outdist_dataset")
    parser.add_argument("--autoattack", action="store_true",
                        help="also AutoAttack accuracy (pyautoattack, standard version)")
    parser.add_argument("--metrics", type=metric_list, default=[], metavar="NAME,...",
                        help="more metrics by registry name (rebm.eval.registry), e.g. "
                             "inception_score,precision_recall,samples_npz")
    return parser


def check_metrics(args, cfg) -> None:
    """Unknown metric names fail here (one line); `--check`: what the metrics lack on this
    machine, as warnings (the run itself would stop)."""
    from rebm.distributed import Runtime
    from rebm.eval.evaluator import Evaluator

    evaluation = cfg.evaluation
    problems = Evaluator(evaluation, Runtime(), evaluation_metrics(evaluation, args)).problems()
    if args.check:
        for problem in problems:
            print(f"warning: {problem}", file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> int:
    return cli.run_entry(build_parser(), argv, evaluate_command_all_ranks, prepare=check_metrics)


if __name__ == "__main__":
    sys.exit(main())
