"""The files a training run reads, checked before anything starts: the datasets' files (inside
their folders: CIFAR's batches, tiny_images.bin, the exclusion lists, ...), the starting weights
(model.ckpt_path) and what the periodic evaluation reads (seed images, FID statistics, Inception
weights, OOD sets). A run that lacks some names all of them in one error, each with where it
comes from, before the model, the data or any file of the run directory (only the process group
is up: each rank checks its own machine); `--check` warns about the same files."""

from __future__ import annotations

import os
from typing import List

from rebm.checkpoint.paths import check_starting_weights
from rebm.config.datasets import INDIST_ROLE, dataset_files, missing_lines
from rebm.config.sections import RunSection
from rebm.config.views import EvaluationSection
from rebm.distributed.collectives import on_every_rank
from rebm.distributed.runtime import Runtime
from rebm.errors import UserError
from rebm.eval.evaluator import Evaluator
from rebm.eval.registry import standard_metrics
from rebm.methods.base import Method

# where an evaluation's file comes from, by the key that names it
EVALUATION_FILE_SOURCES = {
    "image_log.seed_images": "the samples' seed images (the CIFAR recipes read the original's "
                             "file, which no script writes: docs/data.md), or set "
                             "image_log.seed_images=lowfreq-noise",
}
STARTING_WEIGHTS_SOURCE = ("the starting weights: a finished run's model_final.pth or its run "
                           "directory (stage 2 starts from stage 1's), or model.ckpt_path=null")


class MissingInputs(UserError):
    """Files a run reads are missing here (one line each)."""


def run_input_problems(evaluation: EvaluationSection, run: RunSection, evaluates: bool,
                       training_method: Method) -> List[str]:
    """What a training run reads and this machine lacks, one line each, with where it comes
    from: the datasets of its method's streams and the in-distribution (`evaluation.data`), its
    starting weights (`evaluation.model`; `run`: a run directory with states resumes and does
    not read them) and, when it `evaluates`, what its evaluations read."""
    roles = dict.fromkeys([INDIST_ROLE, *(s.dataset for s in training_method.streams)])
    lines = missing_lines(dataset_files(evaluation.data, tuple(roles)))
    try:
        check_starting_weights(evaluation.model, run)
    except UserError as err:  # its hint, if any, names runs of the same config
        lines.append(str(err) if ";" in str(err) else f"{err}; {STARTING_WEIGHTS_SOURCE}")
    if evaluates:
        lines += evaluation_problems(evaluation, training_method.eval_samples, named=lines)
    return lines


def evaluation_problems(evaluation: EvaluationSection, eval_samples: bool, named: List[str]
                        ) -> List[str]:
    """What a training run's evaluations lack: their metrics' own problems (FID's network and
    statistics, ...), then each missing file of theirs (seed images, OOD sets, ...) that no line
    of these or of `named` mentions already."""
    evaluator = Evaluator(evaluation, Runtime(), standard_metrics(evaluation, eval_samples))
    lines = evaluator.problems()
    for cls in evaluator.classes:
        for key, path in cls.files(evaluator.sections[cls.name]).items():
            if path and not os.path.exists(path) and not any(path in line
                                                             for line in named + lines):
                source = EVALUATION_FILE_SOURCES.get(key, "see docs/evaluation.md")
                lines.append(f"{key}: {path} does not exist; {source}")
    return lines


def check_run_inputs_all_ranks(runtime: Runtime, evaluation: EvaluationSection, run: RunSection,
                               evaluates: bool, training_method: Method) -> None:
    """Stop every rank with one report of all the files this run lacks on any rank (each rank
    checks its own machine: a node may lack a file the others have); `run_input_problems`'s
    arguments."""
    def check() -> None:
        lines = run_input_problems(evaluation, run, evaluates, training_method)
        if lines:
            raise MissingInputs(missing_report(lines))

    on_every_rank(runtime, check, "find the files the run reads")


def missing_report(lines: List[str]) -> str:
    """The error of a run that lacks files: the line of the one, or a count and a line each."""
    if len(lines) == 1:
        return lines[0]
    return (f"the run lacks {len(lines)} files it reads (nothing was started or written; add "
            "them and run the same command again):\n"
            + "\n".join(f"  - {line}" for line in lines))
