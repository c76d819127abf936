"""The run-level twin: whole stage-2 runs of one recipe by the original DAT code and by rebm,
several seeds a side, compared as distributions (run_stats.py).

Each run is the code's own: the original's `train()` (benchmarks/original/original_run.py, its
loaders, augmentations, curriculum, EMA, evaluation and best-model rule), rebm's
`python -m rebm.training.train` on one process and under torchrun on two. Both read the same
files (run_data.py) with the recipe scaled as run_configs.RUN says. What each run reached is
read back from what it wrote: rebm's metrics.jsonl and samples_step*.npz, the original's
records (original_run.py) and the PNGs of its sample passes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import numpy as np
import torch

from benchmarks.original import run_configs, run_data

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RECIPE = os.path.join(ROOT, "experiments", "cifar10", "cifar10-dat-WideResNet34x10-T40-seed0.yaml")
SIDES = ("original", "rebm1", "rebm2")  # rebm2: two processes (torchrun, gloo)
RUN_TIMEOUT_S = 3 * 3600


def prepare(workdir: str, spec: dict) -> dict:
    """The shared files (once per workdir) and their paths."""
    files = {"indist": os.path.join(workdir, "digits"),
             "tinyimages": os.path.join(workdir, "tinyimages"),
             "seeds": os.path.join(workdir, "seed_images.pt"),
             "stage1": os.path.join(workdir, "stage1.pt")}
    files["exclusion"] = os.path.join(files["tinyimages"], "TinyImagesExclusionIdcs")
    done = os.path.join(workdir, "files.json")
    if os.path.exists(done):
        with open(done) as fh:
            return json.load(fh)
    os.makedirs(workdir, exist_ok=True)
    files["counts"] = run_data.write_digits_as_cifar(files["indist"])
    files["excluded_records"] = run_data.write_tinyimages(
        files["tinyimages"], spec["tinyimages_records"], spec["seed"])
    run_data.write_seed_images(files["seeds"], spec["num_samples"], spec["seed"] + 7)
    files.update(run_data.train_stage1(spec, workdir, files["stage1"]))
    with open(done, "w") as fh:
        json.dump(files, fh)
    return files


def _env(threads: int, pythonpath: List[str]) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "PYTHONPATH")}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               WANDB_MODE="disabled", WANDB_SILENT="true", REBM_NO_PROGRESS="1",
               PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    if any(pythonpath):
        env["PYTHONPATH"] = os.pathsep.join(p for p in pythonpath if p)
    return env


def _run(cmd: List[str], env: dict, cwd: str, log: str) -> float:
    """Run `cmd` to the end, its output in `log`; its seconds. A run that finished before (its
    folder's `done` file) is not run again: a stopped twin continues where it stopped."""
    done = os.path.join(os.path.dirname(log), "done")
    if os.path.exists(done):
        with open(done) as fh:
            return float(fh.read())
    started = time.perf_counter()
    # each run in its own session: with the kernel's autogroup scheduling, the runs started
    # from one session share one process's CPU share (torchrun's workers have their own)
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT,
                              timeout=RUN_TIMEOUT_S, start_new_session=True)
    if proc.returncode != 0:
        with open(log) as fh:
            tail = "".join(fh.readlines()[-12:])
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}); {log} ends:\n"
                           f"{tail}")
    seconds = time.perf_counter() - started
    with open(done, "w") as fh:
        fh.write(f"{seconds:.1f}")
    return seconds


def run_original(spec: dict, files: dict, seed: int, folder: str, checkout: str,
                 extra_path: Optional[str]) -> dict:
    """One run of the original's train(); its records (original_run.py)."""
    import yaml

    os.makedirs(folder, exist_ok=True)
    # the original reads its exclusion lists from ./InNOutRobustness/TinyImagesExclusionIdcs
    lists = os.path.join(folder, "InNOutRobustness", "TinyImagesExclusionIdcs")
    if not os.path.exists(lists):
        os.makedirs(os.path.dirname(lists))
        os.symlink(files["exclusion"], lists)
    config = os.path.join(folder, "config.yaml")
    with open(config, "w") as fh:
        yaml.safe_dump(run_configs.original_values(spec, files, seed, folder), fh)
    result = os.path.join(folder, "result.json")
    paths = [p for p in (extra_path or "").split(os.pathsep) if p]
    seconds = _run([sys.executable, os.path.join(HERE, "original_run.py"), checkout, config,
                    result], _env(1, paths), folder, os.path.join(folder, "log.txt"))
    with open(result) as fh:
        record = json.load(fh)
    samples = {int(name[len("samples_step"):-4]): os.path.join(folder, name)
               for name in os.listdir(folder) if name.startswith("samples_step")}
    return {"T": [s["T"] for s in record["steps"]],
            "adv_auc": [s["adv_auc"] for s in record["steps"]],
            "evaluations": record["evaluations"],
            "samples": samples, "bestacc_writes": record["bestacc_writes"],
            "seconds": seconds}


def run_rebm(spec: dict, files: dict, seed: int, folder: str, nproc: int) -> dict:
    """One run of `python -m rebm.training.train` (torchrun with two processes)."""
    run_dir = os.path.join(folder, "run")
    args = [RECIPE, *run_configs.rebm_overrides(spec, files, seed, run_dir)]
    if nproc == 1:
        cmd = [sys.executable, "-m", "rebm.training.train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", "-m", "rebm.training.train", *args]
    os.makedirs(folder, exist_ok=True)
    env = _env(1, [ROOT])
    seconds = _run(cmd, env, ROOT, os.path.join(folder, "log.txt"))
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    T = [r["cur_outdist_steps"] for r in records if "cur_outdist_steps" in r]
    adv_auc = [r["train_adv_auc"] for r in records if "train_adv_auc" in r]
    evaluations = [{"step": r["step"], "test_acc": r["test_acc"],
                    "robust_test_acc": r["robust_test_acc"]}
                   for r in records if "robust_test_acc" in r]
    samples_dir = os.path.join(run_dir, "samples")
    samples = {int(name[len("samples_step"):-4]): os.path.join(samples_dir, name)
               for name in os.listdir(samples_dir)
               if name.startswith("samples_step") and name.endswith(".npz")}
    return {"T": T, "adv_auc": adv_auc, "evaluations": evaluations, "samples": samples,
            "seconds": seconds}


def load_samples(path: str) -> torch.Tensor:
    """uint8 N x S x S x 3 (the original's PNGs, rebm's npz) as float [0, 1] NCHW."""
    pixels = np.load(path)["arr_0"] if path.endswith(".npz") else np.load(path)
    return torch.from_numpy(pixels).permute(0, 3, 1, 2).float().div(255)


def run_all(spec: dict, workdir: str, seeds: List[int], sides: List[str], checkout: str,
            extra_path: Optional[str], parallel: int) -> Dict[str, Dict[int, dict]]:
    """Every (side, seed) run, `parallel` at a time; each side's runs keyed by seed."""
    files = prepare(workdir, spec)
    jobs = [(side, seed) for side in sides for seed in seeds]  # the slower sides first

    def one(job):
        side, seed = job
        folder = os.path.join(workdir, f"{side}_seed{seed}")
        started = ("a run kept from before" if os.path.exists(os.path.join(folder, "done"))
                   else f"started {time.strftime('%H:%M:%S')}")
        if side == "original":
            out = run_original(spec, files, seed, folder, checkout, extra_path)
        else:
            out = run_rebm(spec, files, seed, folder, int(side[-1]))
        print(f"  {side} seed {seed}: {started}, {out['seconds']:.0f} s", flush=True)
        return job, out

    results: Dict[str, Dict[int, dict]] = {side: {} for side in sides}
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        for (side, seed), out in pool.map(one, jobs):
            results[side][seed] = out
    return results
