"""Stage 1: adversarial training with live BatchNorm (In-N-Out style, mean-0 fill augmentation).

    torchrun --nproc_per_node=N InNOutRobustnessMean0_cifar100/train_at.py [CONFIG] [key=value ...]
    python InNOutRobustnessMean0_cifar100/train_at.py [CONFIG] --nproc N [key=value ...]

Loss per step: CE(f(PGD_K^CE(x_c)), y_c) with the `indist_attack_clf` threat model, on the
classification stream of rebm's data pipeline (rebm.methods.at, run by the same engine as DAT).
CONFIG defaults to configs/cifar100_wrn34x10.yaml (`--dataset cifar10`:
configs/cifar10_wrn34x10.yaml). Writes <run_dir>/model_final.pth (EMA weights when use_ema), a
DAT run's `model.ckpt_path`. Training states go to <run_dir>/checkpoints/; the same command
resumes from the newest (as in stage 2). The learning rate follows `lr_schedule` of the config
(cosine unless it says constant); `--schedule NAME` is the same as the override
`lr_schedule=NAME`.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

from rebm import cli
from rebm.config import ConfigError, explicit_keys
from rebm.config.origins import config_origins
from rebm.methods.stages import STAGE1

HERE = os.path.dirname(os.path.abspath(__file__))
DATASETS = {"cifar100": 100, "cifar10": 10}
SCHEDULES = STAGE1.schedules  # the values of lr_schedule (and --schedule) stage 1 offers


def train_stage1_all_ranks(cfg, runtime, _args) -> dict:
    from rebm.engine.trainer import train

    return train(cfg, runtime, make_training_method)


def make_training_method(cfg):
    """Stage 1's method on the config's sections it reads (the engine's method factory)."""
    return method_class()(cfg.method, cfg.model, cfg.schedule)


def method_class():
    """This entry's method, stage 1's adversarial training (imported when called: `--help`
    imports no torch)."""
    from rebm.methods.at import AdversarialTraining

    return AdversarialTraining


def check_stage1(args, cfg) -> None:
    """The method's config rules (stage 1's: live BatchNorm, a schedule it offers), and one
    warning line (rank 0's) naming the stage-2 keys the config sets, which stage 1 does not read."""
    origins = config_origins(args.config, args.overrides)  # errors name where a key was set
    method_class().check_config(cfg.method, cfg.model, cfg.schedule, origins)
    unread = STAGE1.unread_keys_set(explicit_keys(cfg))
    if unread and os.environ.get("RANK", "0") == "0":
        print(f"warning: stage 1 does not read {', '.join(unread)} (stage-2 keys, DAT's); "
              "they have no effect here: remove them from the stage-1 config", file=sys.stderr)


def build_parser():
    # CONFIG is optional: --dataset picks a bundled one
    parser = cli.build_parser("train_at.py", __doc__.splitlines()[0], config_optional=True)
    parser.epilog = __doc__.split("\n", 2)[2]
    parser.add_argument("--dataset", choices=tuple(DATASETS),
                        help="without CONFIG: its bundled config; with CONFIG: overrides "
                             "data.indist_dataset and data.num_classes (default cifar100)")
    parser.add_argument("--nproc", type=int, default=1,
                        help="start N processes with torch.multiprocessing.spawn (no torchrun)")
    parser.add_argument("--schedule", choices=SCHEDULES,
                        help="the same as the override lr_schedule=NAME (the config key, which "
                             "config.yaml records); unset: the config's, by default cosine")
    return parser


def with_default_config(argv: Optional[List[str]]) -> List[str]:
    """argv with the bundled config filled in when only overrides (or nothing) were given, and
    --dataset turned into the overrides it stands for."""
    args = build_parser().parse_intermixed_args(argv)
    overrides = list(args.overrides)
    config = args.config
    if config and "=" in config and not os.path.isfile(config):
        overrides.insert(0, config)  # only overrides were given
        config = None
    if config is None:
        config = os.path.join(HERE, "configs", f"{args.dataset or 'cifar100'}_wrn34x10.yaml")
    elif args.dataset:
        overrides[:0] = [f"data.indist_dataset={args.dataset}",
                         f"data.num_classes={DATASETS[args.dataset]}"]
    if args.schedule:
        overrides.append(schedule_override(overrides, args.schedule))
    flags = [f"--nproc={args.nproc}", *(["--check"] if args.check else []),
             *(["--all"] if args.all else [])]
    return [config, *overrides, *flags]


def schedule_override(overrides: List[str], schedule: str) -> str:
    """`--schedule NAME` as the override it stands for; refused next to another lr_schedule."""
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "lr_schedule" and value != schedule:
            raise ConfigError(f"command line: '--schedule {schedule}' and '{item}' disagree "
                              "(--schedule sets lr_schedule); give only lr_schedule=...")
    return f"lr_schedule={schedule}"


def main(argv: Optional[List[str]] = None) -> int:
    with cli.user_errors_exit():
        argv = with_default_config(sys.argv[1:] if argv is None else argv)
    return cli.run_entry(build_parser(), argv, train_stage1_all_ranks, prepare=check_stage1,
                         method_class=method_class)


if __name__ == "__main__":
    sys.exit(main())
