"""Shared command-line plumbing of the entry points (both training stages, evaluation, the
robustness test): arguments, config loading, `--check`, the launch (this process, or N spawned
ones), and turning the user-fixable errors into one line and a non-zero exit."""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional

from rebm.config import (
    BatchPlan,
    ConfigError,
    TrainConfig,
    default_run_dir,
    ignored_fields_notice,
    load_config,
    plan_batches,
    replace,
    to_dict,
    to_yaml,
)
from rebm.config.schema import SEED_NOISES
from rebm.config.sections import DistributedSection, MethodSection
from rebm.errors import UserError

EXIT_USER_ERROR = 2
# see error_delay_s; 2 s was too short for torchrun to stop the other ranks on a loaded 2-core
# machine, and a job printed two lines
OTHER_RANKS_ERROR_GRACE_S = 5.0
WANDB_ENV_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")  # wandb's own


def build_parser(prog: str, description: str, config_optional: bool = False,
                 example: str = "lr=0.01 data.num_workers=0 attack.max_steps=5"
                 ) -> argparse.ArgumentParser:
    """The arguments every entry point shares. Importing this module does not import torch, so
    `--help` answers at once."""
    launch = f"-m {prog}" if "." in prog and not prog.endswith(".py") else prog
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            f"overrides: key=value or a.b=value (OmegaConf dot-list), e.g. {example}\n"
            f"launch on N processes with: torchrun --nproc_per_node=N {launch} CONFIG ..."
        ),
    )
    parser.add_argument("config", nargs="?" if config_optional else None,
                        help="experiment YAML file")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    parser.add_argument("--check", action="store_true",
                        help="validate the config, print the keys it sets and the values that "
                             "differ from the defaults, resolved, as YAML, and exit")
    parser.add_argument("--all", action="store_true",
                        help="with --check: print the whole resolved config")
    return parser


def environment_warnings(cfg: TrainConfig) -> List[str]:
    """Things this machine lacks; warnings under --check (login nodes have no data or GPUs)."""
    import torch

    from rebm.config.datasets import dataset_files, missing_lines

    # inside the datasets' folders too: every missing file at once, with where it comes from
    problems = missing_lines(dataset_files(cfg.data))
    seeds = cfg.image_log.seed_images
    if seeds not in SEED_NOISES and not os.path.exists(seeds):
        problems.append(f"image_log.seed_images '{seeds}' does not exist here")
    if cfg.model.ckpt_path and not os.path.exists(cfg.model.ckpt_path):
        problems.append(f"model.ckpt_path '{cfg.model.ckpt_path}' does not exist here")
    if cfg.distributed.ddp_backend == "nccl" and not torch.cuda.is_available():
        problems.append("ddp_backend: nccl needs CUDA, which this machine does not have")
    if cfg.distributed.device == "cuda" and not torch.cuda.is_available():
        problems.append("device: cuda but CUDA is not available on this machine")
    return problems


GPU_MEM_KEY = "gpu_mem_gib"


LossStreams = Callable[[MethodSection], int]  # a method's `loss_streams`
# A training entry's method class, imported when called (after the arguments parsed: `--help`
# imports no torch)
MethodLoader = Callable[[], Any]


def memory_plan_lines(cfg: TrainConfig, batches: BatchPlan, streams: int,
                      gpu_mem_gib: Optional[float] = None) -> List[str]:
    """The per-device memory plan (rebm.models.memory) of a training run of `cfg` whose loss
    pass holds `streams` micro-batches (the method's `loss_streams`, e.g. DAT's fused forward
    over in-dist, negatives and classifier stream, plus clean out-dist when weighted): the
    model is built on this CPU and one tiny batch goes through it at data.image_size."""
    from rebm.models import model_from_config
    from rebm.models.memory import GIB, plan_memory, uninitialised_copy

    world_size, micro_batch = batches.world_size, batches.per_device_batch_size
    model = uninitialised_copy(lambda: model_from_config(cfg.model, cfg.data))
    plan = plan_memory(model, cfg.data.image_size, micro_batch, streams,
                       cfg.optimization.name, cfg.ema.use_ema, world_size, amp=cfg.distributed.amp,
                       eval_batch=batches.eval_batch_size)
    lines = [f"# memory plan per device (world size {world_size}, micro-batch {micro_batch} x "
             f"{streams} streams, {cfg.data.image_size} px, {cfg.model.model_type}):"]
    lines += plan.lines()
    if gpu_mem_gib is not None:
        fits = plan.largest_micro_batch(gpu_mem_gib * GIB)
        lines.append(f"# largest per_device_batch_size that fits {gpu_mem_gib:g} GiB (10% kept "
                     f"free for CUDA context, workspaces, fragmentation): {fits}")
    return lines


def config_summary(cfg: TrainConfig) -> str:
    """--check's view of a config: the keys its file and command line set, and the values that
    differ from the schema's defaults without being set (a dataset's image size, a model's
    stem), resolved, as YAML in the schema's order; one comment line counts the rest."""
    from omegaconf import OmegaConf

    from rebm.config import explicit_keys, to_dict
    from rebm.config.identity import flatten

    values, defaults = flatten(to_dict(cfg)), flatten(to_dict(TrainConfig()))
    explicit = set(explicit_keys(cfg))
    shown: dict = {}
    for key, value in values.items():
        if key in explicit or defaults.get(key, object()) != value:
            node = shown
            for part in key.split(".")[:-1]:
                node = node.setdefault(part, {})
            node[key.split(".")[-1]] = value
    rest = len(values) - len(flatten(shown))
    return (OmegaConf.to_yaml(OmegaConf.create(shown))
            + f"# {rest} more keys at their defaults (--check --all prints every key)\n")


def print_config_and_plan(cfg: TrainConfig, gpu_mem_gib: Optional[float] = None,
                          loss_streams: Optional[LossStreams] = None, show_all: bool = False) -> int:
    """--check: validate what can be validated here, print the config (`show_all`: every key;
    else config_summary) and the memory plan (`gpu_mem_gib`: also the largest micro-batch that
    fits a device of that size) of a training entry's method (`loss_streams`), exit 0."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    streams = loss_streams(cfg.method) if loss_streams is not None else None
    plan = (plan_batches(cfg.schedule, cfg.eval, world_size) if streams is None
            else plan_batches(cfg.schedule, cfg.eval, world_size, streams))
    for problem in environment_warnings(cfg):
        print(f"warning: {problem}", file=sys.stderr)
    notice = ignored_fields_notice(cfg)
    if notice:
        print(f"note: {notice}", file=sys.stderr)
    print(to_yaml(cfg) if show_all else config_summary(cfg), end="")
    print(
        f"# batch plan at world size {world_size}: {plan.per_device_batch_size} per device x "
        f"{plan.accumulation_steps} accumulation step(s) x {world_size} = {plan.global_batch_size}"
    )
    if streams is not None:
        for line in memory_plan_lines(cfg, plan, streams, gpu_mem_gib):
            print(line)
    return 0


def pop_check_options(args: argparse.Namespace) -> Optional[float]:
    """`--check gpu_mem_gib=80`: the value lands among the overrides (it is not a config key);
    take it out. None when absent."""
    found = [o for o in args.overrides if o.startswith(GPU_MEM_KEY + "=")]
    if not found:
        return None
    args.overrides = [o for o in args.overrides if o not in found]
    if not args.check:
        raise ConfigError(f"'{found[0]}' only goes with --check (it sizes the memory plan)")
    value = found[-1].split("=", 1)[1]
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{GPU_MEM_KEY} must be a number of GiB, e.g. {GPU_MEM_KEY}=80; "
                          f"got '{value}'") from None


def one_line(err: BaseException) -> str:
    """The error's own message. An error re-raised from a DataLoader worker carries the worker's
    traceback in its message; keep only its last line, the original message."""
    text = str(err)
    if "\nOriginal Traceback" in text:
        last = [line for line in text.splitlines() if line.strip()][-1]
        text = last.split(": ", 1)[1] if ": " in last else last
    return text


@contextmanager
def user_errors_exit() -> Iterator[None]:
    """A user-fixable error prints one line (no traceback) and exits with code 2."""
    try:
        yield
    except UserError as err:
        rank = os.environ.get("RANK")
        if rank is not None:
            time.sleep(error_delay_s(rank, err))
        prefix = f"[rank {rank}] " if rank is not None else ""
        line = f"{prefix}error: {one_line(err)}"
        print(line, file=sys.stderr, flush=True)
        if rank is not None:
            from rebm.distributed.logs import report_to_launcher

            report_to_launcher(line)
        raise SystemExit(EXIT_USER_ERROR) from None


def error_delay_s(rank: str, err: UserError) -> float:
    """How long a rank of a launched job waits before printing its error, so that a job prints
    one line: the launcher (torchrun, --nproc) stops every rank as soon as one exits with an
    error. Rank 0 reports at once an error of its own (one that every rank meets, like a bad
    config, is rank 0's to report); another rank's own error comes after one grace period;
    "rank N could not ..." (RankFailed, an echo of another rank's error) after two, so the
    rank that met the error reports it. A rank nobody stops still prints after its wait."""
    from rebm.distributed.collectives import RankFailed

    if isinstance(err, RankFailed):
        return 2 * OTHER_RANKS_ERROR_GRACE_S
    return 0.0 if rank == "0" else OTHER_RANKS_ERROR_GRACE_S


def check_environment() -> None:
    """Environment variables are input too. An empty WANDB_MODE (what `export WANDB_MODE=`
    leaves) means unset: it is removed, as wandb would fail on it in rank 0's wandb.init. A
    value wandb does not know is one line here, in every process, before any process-group
    work (wandb would fail on it only later, on rank 0)."""
    mode = os.environ.get("WANDB_MODE")
    if mode is not None and not mode.strip():
        del os.environ["WANDB_MODE"]
    elif mode is not None and mode not in WANDB_ENV_MODES:
        raise ConfigError(f"environment variable WANDB_MODE='{mode}' is not a wandb mode; set "
                          "it to online, offline or disabled, or unset it")


Body = Callable[[TrainConfig, Any, argparse.Namespace], Any]  # an entry's body (cfg, runtime, args)
Worker = Callable[[Any, argparse.Namespace], Any]  # what each process runs: (runtime, args)


def run_entry(parser: argparse.ArgumentParser, argv: Optional[List[str]], body: Body,
              prepare: Optional[Callable[[argparse.Namespace, TrainConfig], None]] = None,
              method_class: Optional[MethodLoader] = None) -> int:
    """The shared body of the entry points: parse, load and validate the config (`prepare` adds
    the entry's own checks; `--check` stops there), then run `body(cfg, runtime, args)` in this
    process, or in `args.nproc` spawned ones when the parser has `--nproc`. A training entry
    names its method (`method_class`, a loader of its class): it is a training run, so `--check`
    prints that method's memory plan (its `loss_streams`) and a config without `run_dir` gets the deterministic
    default. A user-fixable error anywhere is one line
    and exit code 2."""
    with user_errors_exit(), collector_paused():  # loading the config imports torch already
        args, cfg = parse_and_load(parser, argv, with_default_run_dir=method_class is not None)
        check_environment()
        if prepare is not None:
            prepare(args, cfg)
        if args.check:
            streams = method_class().loss_streams if method_class is not None else None
            return print_config_and_plan(cfg, args.gpu_mem_gib, streams, args.all)
        nproc = getattr(args, "nproc", 1)
        if nproc > 1:
            if "WORLD_SIZE" in os.environ:
                raise ConfigError("--nproc starts its own processes: do not combine it with "
                                  "torchrun")
            plan_batches(cfg.schedule, cfg.eval, nproc)  # fail here, once, not in N children
    return launch(functools.partial(body, cfg), args, nproc, cfg.distributed)


def launch(work: Worker, args: argparse.Namespace, nproc: int,
           distributed: DistributedSection, timeout_setting: str = "ddp_timeout_s") -> int:
    """Run `work(runtime, args)` in this process (plain, or a rank of torchrun) or in `nproc`
    spawned ones, each through `run_worker`; 0, or the exit of a failed child. The process group
    follows `distributed` (the config's section; the table runner's, whose rows each have their
    own config, is made of its options, whose timeout is `timeout_setting`)."""
    import_libraries()  # once the arguments are good
    from torch.multiprocessing import ProcessExitedException

    from rebm.distributed.launch import spawn

    try:
        spawn(run_worker, nproc, work, args, distributed, timeout_setting)
    except ProcessExitedException as err:  # a child's one-line error was printed already
        raise SystemExit(err.exit_code or 1) from None
    return 0


@contextmanager
def collector_paused() -> Iterator[None]:
    """Run a process's start with the cyclic garbage collector paused, then freeze what it made.
    The start imports torch and torchvision (every entry's models and data need them; loading a
    config does already): about half a million objects. Collecting while they are made costs
    about 1.5 CPU-seconds per process, a quarter of its start (benchmarks/bench_startup.py);
    frozen, they are skipped by every later collection of the run. The price: the start's few
    thousand garbage objects are never freed (a fixed few MB; one full collection to free them
    would cost 0.6 s)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def import_libraries() -> None:
    """Import torch and torchvision with the collector paused (collector_paused)."""
    with collector_paused():
        import torch  # noqa: F401
        import torchvision  # noqa: F401


def run_worker(work: Worker, args: argparse.Namespace, distributed: DistributedSection,
               timeout_setting: str) -> None:
    """One process (plain, torchrun or spawned): its rank comes from the environment. torchrun's
    `record` writes a failing worker's error where the agent reports it (its first line: the
    worker prints the traceback itself); every error, one-line or not, also goes to this rank's
    log file."""
    import_libraries()  # a spawned rank starts here (torch.multiprocessing imported torch)
    from torch.distributed.elastic.multiprocessing.errors import record

    from rebm.distributed.logs import SummaryErrorHandler

    record(_worker, SummaryErrorHandler())(work, args, distributed, timeout_setting)


def _worker(work: Worker, args: argparse.Namespace, distributed: DistributedSection,
            timeout_setting: str) -> None:
    from rebm.distributed.collectives import name_missing_ranks
    from rebm.distributed.logs import log_to_file, report_to_launcher
    from rebm.distributed.runtime import setup_distributed, teardown

    with user_errors_exit():
        runtime = setup_distributed(use_ddp=distributed.use_ddp, backend=distributed.ddp_backend,
                                    device=distributed.device,
                                    timeout_s=distributed.ddp_timeout_s)
        try:
            with name_missing_ranks(runtime, lambda: "",
                                    start_up_timeout_advice(distributed, timeout_setting)):
                work(runtime, args)
        except UserError as err:
            log_to_file(f"error: {one_line(err)}")
            raise
        except SystemExit:  # an entry's own exit (e.g. stopped by a signal, said already)
            raise
        except KeyboardInterrupt:  # Ctrl-C outside the training loop (start-up, evaluation)
            log_to_file("interrupted")
            line = "interrupted: nothing to save at this point"
            print(line, file=sys.stderr, flush=True)
            report_to_launcher(line)
            raise SystemExit(130) from None
        except BaseException as err:
            log_to_file("uncaught error", exc_info=err)
            raise
        finally:
            teardown(runtime)


def start_up_timeout_advice(distributed: DistributedSection,
                            setting: str = "ddp_timeout_s") -> str:
    """What a rank that waited for another in a collective outside training's steps (start-up,
    an evaluation entry) may raise: the process group's timeout, `setting` (the table's is an
    option)."""
    return (f"Raise {setting} (now {distributed.ddp_timeout_s:g} s) if the ranks are "
            "legitimately slower there.")


def parse_and_load(parser: argparse.ArgumentParser, argv: Optional[List[str]] = None,
                   with_default_run_dir: bool = False) -> tuple:
    """(args, config); with `with_default_run_dir`, a config without `run_dir` gets the
    deterministic default, so running the same command again continues the same run."""
    args = parser.parse_intermixed_args(argv)  # flags may come before or after overrides
    args.gpu_mem_gib = pop_check_options(args)
    if getattr(args, "all", False) and not args.check:
        raise ConfigError("--all only goes with --check (it prints the whole config)")
    cfg = load_config(args.config, args.overrides)
    if with_default_run_dir and cfg.run.run_dir is None:
        run_dir = default_run_dir(args.config, args.overrides, to_dict(cfg))
        cfg = replace(cfg, run_dir=run_dir)
    return args, cfg
