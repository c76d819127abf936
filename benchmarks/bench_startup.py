"""What one process's start costs, and what the test suite's forked starts save (docs/performance.md,
"Start-up"). CPU-seconds (user + system) of:

  import        a new interpreter importing torch and torchvision
  import-nogc   the same through rebm.cli.import_libraries (collector paused, then frozen)
  run-collecting  `python -m rebm.training.train` on the quickstart digits, 2 steps, no evaluation,
                with the collector running through the start (rebm.cli.collector_paused replaced by
                a no-op: how the entry points started before)
  run-fresh     the same command as it runs (its start under rebm.cli.collector_paused)
  run-forked    the same command forked by tests/processes.py from its preloaded server

    .venv/bin/python benchmarks/bench_startup.py [--reps 5]

The four are measured in turn, `--reps` rounds, so drift hits all alike; medians and the ratios of
medians are printed. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RUN = ["-m", "rebm.training.train", "experiments/quickstart/digits.yaml", "max_steps=2",
       "batch_size=32", "n_imgs_per_evaluation_log=null", "image_log.num_samples=4",
       "image_log.num_steps=1", "robust_eval_steps=1"]


# The training entry with the start's collector pause made a no-op (argv: the module, then its
# arguments).
COLLECTING = ("import contextlib, runpy, sys\n"
              "import rebm.cli\n"
              "rebm.cli.collector_paused = contextlib.nullcontext\n"
              "sys.argv = sys.argv[1:]\n"
              "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def server_cpu() -> float:
    """CPU of the forkserver's reaped children (the forked commands), from /proc."""
    from multiprocessing import forkserver

    pid = forkserver._forkserver._forkserver_pid
    if pid is None:  # not started yet
        return 0.0
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def fresh(args: list, env: dict) -> float:
    before = children_cpu()
    subprocess.run([sys.executable, *args], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return children_cpu() - before


def forked(args: list, env: dict) -> float:
    from tests.processes import popen

    before = server_cpu()
    proc = popen([sys.executable, *args], env, ROOT)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-2000:]
    return server_cpu() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    reps = parser.parse_args().reps
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    cases = {
        "import": lambda run_dir: fresh(["-c", "import torch, torchvision"], env),
        "import-nogc": lambda run_dir: fresh(
            ["-c", "from rebm.cli import import_libraries; import_libraries()"], env),
        "run-collecting": lambda run_dir: fresh(["-c", COLLECTING, *RUN[1:],
                                                 f"run_dir={run_dir}"], env),
        "run-fresh": lambda run_dir: fresh([*RUN, f"run_dir={run_dir}"], env),
        "run-forked": lambda run_dir: forked([*RUN, f"run_dir={run_dir}"], env),
    }
    times = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as tmp:
        # start the server once before measuring (its preload is paid once per pytest worker)
        forked([*RUN, f"run_dir={tmp}/warm"], env)
        for rep in range(reps):
            for name, case in cases.items():
                times[name].append(case(f"{tmp}/{name}{rep}"))
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"machine: {os.cpu_count()} cores, python {sys.version.split()[0]}, {reps} rounds")
    for name, value in median.items():
        print(f"{name:15s} median {value:5.2f} CPU-s   (all: "
              f"{', '.join(f'{v:.2f}' for v in times[name])})")
    print(f"import-nogc / import     {median['import-nogc'] / median['import']:.2f}")
    print(f"run-fresh / run-collecting {median['run-fresh'] / median['run-collecting']:.2f}")
    print(f"run-forked / run-fresh   {median['run-forked'] / median['run-fresh']:.2f}")


if __name__ == "__main__":
    main()
