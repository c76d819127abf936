"""What handling a config costs where it is done often (docs/performance.md, "Configs"):

  to_dict       the config as plain dicts, as every training state stores it: through OmegaConf
                (structured, then to_container) against rebm.config.to_dict (dataclasses.asdict)
  table-configs the configs of every (row, metric) of a paper table before it starts: one
                load_config per pair against rebm.eval.table.row_sections (once per row and set
                of overrides)

    .venv/bin/python benchmarks/bench_config.py [--reps 5] [--table experiments/paper/cifar10.yaml]

Each pair is measured in turn, `--reps` rounds, so drift hits both alike; medians (seconds of
CPU time of this process) and the ratio of medians are printed. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIG = os.path.join(ROOT, "experiments", "cifar10",
                      "cifar10-dat-WideResNet34x10-T40-seed0.yaml")


def cpu(fn, repeat: int = 1) -> float:
    start = time.process_time()
    for _ in range(repeat):
        fn()
    return (time.process_time() - start) / repeat


def omegaconf_dict(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))


def every_pair(spec, checkpoint_root: str) -> dict:
    """What row_sections did before: one load_config per (row, metric)."""
    from rebm.config import load_config

    return {row.name: {metric: load_config(row.config, [*spec.row_overrides(row, metric),
                                                        f"model.ckpt_path={checkpoint_root}"])
                       for metric in spec.metrics}
            for row in spec.rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--table", default=os.path.join(ROOT, "experiments", "paper", "cifar10.yaml"))
    args = parser.parse_args()
    os.chdir(ROOT)  # the tables name their configs relative to the repository

    from rebm.config import load_config, to_dict
    from rebm.eval.table.spec import load_table, row_sections

    cfg = load_config(CONFIG)
    assert to_dict(cfg) == omegaconf_dict(cfg)
    spec = load_table(args.table)
    pairs = len(spec.rows) * len(spec.metrics)
    times = {name: [] for name in ("to_dict OmegaConf", "to_dict asdict",
                                   "table every pair", "table row_sections")}
    for _ in range(args.reps):
        times["to_dict OmegaConf"].append(cpu(lambda: omegaconf_dict(cfg), 20))
        times["to_dict asdict"].append(cpu(lambda: to_dict(cfg), 20))
        times["table every pair"].append(cpu(lambda: every_pair(spec, "ckpts")))
        times["table row_sections"].append(cpu(lambda: row_sections(spec, "ckpts")))
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"config {os.path.relpath(CONFIG, ROOT)}; table {os.path.relpath(args.table, ROOT)}: "
          f"{len(spec.rows)} rows x {len(spec.metrics)} metrics = {pairs} pairs; "
          f"{args.reps} rounds, median CPU-seconds")
    for name, value in medians.items():
        print(f"  {name:20s} {value * 1000:9.2f} ms")
    print(f"  to_dict ratio      {medians['to_dict asdict'] / medians['to_dict OmegaConf']:.4f}")
    print(f"  table ratio        "
          f"{medians['table row_sections'] / medians['table every pair']:.3f}")


if __name__ == "__main__":
    main()
