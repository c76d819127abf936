"""DAT training (stage 2): `python -m rebm.training.train CONFIG [key=value ...]`.

Launch on N processes with `torchrun --nproc_per_node=N -m rebm.training.train CONFIG`. The loop
is rebm.engine.trainer (the same for stage 1); the method is rebm.methods.dat. Heavy modules are
imported when training starts, so `--help` answers at once.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

from rebm import cli


def train_dat_all_ranks(cfg, runtime, _args) -> dict:
    from rebm.engine.trainer import train

    return train(cfg, runtime, make_training_method)


def make_training_method(cfg):
    """DAT on the config's sections it reads (the engine's method factory)."""
    from rebm.methods.dat import DAT

    return DAT(cfg.method, cfg.model, cfg.schedule)


def method_class():
    """This entry's method, DAT (imported when called: `--help` imports no torch)."""
    from rebm.methods.dat import DAT

    return DAT


def check_dat(args, cfg) -> None:
    """DAT's own config rules (stage 2's included: a constant rate), an error naming where the
    key was set (the command line or the file); under `--check`, also
    what its evaluations lack on this machine (the Evaluator's problems: FID's files, ...), as
    warnings (training would stop at start), and how many training images there are against
    batch_size."""
    from rebm.config.origins import config_origins
    from rebm.methods.dat import DAT

    DAT.check_config(cfg.method, cfg.model, cfg.schedule,
                     config_origins(args.config, args.overrides))
    if args.check:
        from rebm.config import plan_batches
        from rebm.engine.run_files import evaluation_problems

        # a batch split that cannot work is the one line --check prints, before any note
        plan_batches(cfg.schedule, cfg.eval, int(os.environ.get("WORLD_SIZE", "1")), DAT.loss_streams(cfg.method))
        # what its evaluations would stop on at start, besides the files every entry's
        # --check names (cli.environment_warnings)
        for problem in evaluation_problems(cfg.evaluation, DAT.eval_samples,
                                           named=cli.environment_warnings(cfg)):
            print(f"warning: {problem}", file=sys.stderr)
        line = training_images_line(cfg.inputs)
        if line:
            print(line, file=sys.stderr)


def training_images_line(inputs) -> Optional[str]:
    """'note: N training images, S steps per epoch at batch_size B', or a warning when the
    data cannot be read here or holds fewer images than one global batch; None when the data
    folder is not on this machine (--check warns about that already). `inputs`: the config's
    inputs section."""
    from rebm.data import indist_source
    from rebm.errors import UserError

    try:
        n = len(indist_source(inputs.data, "train"))
    except UserError as err:
        if not os.path.exists(inputs.data.indist_ds_dir):
            return None
        return f"warning: the training images cannot be counted here: {err}"
    if n < inputs.schedule.batch_size:
        return (f"warning: batch_size={inputs.schedule.batch_size} is larger than the {n} training images "
                f"of {inputs.data.indist_dataset}; training would stop at start (lower batch_size "
                "or point data.indist_ds_dir at the full data)")
    return (f"note: {n} training images of {inputs.data.indist_dataset}, "
            f"{n // inputs.schedule.batch_size} steps per epoch at batch_size={inputs.schedule.batch_size}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = cli.build_parser("rebm.training.train", __doc__.splitlines()[0])
    return cli.run_entry(parser, argv, train_dat_all_ranks, prepare=check_dat, method_class=method_class)


if __name__ == "__main__":
    sys.exit(main())
