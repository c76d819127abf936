"""Peak memory of a sharded sample evaluation (FID) at two sample counts.

    .venv/bin/python benchmarks/bench_eval_memory.py [--samples 2000 8000] [--nproc 2]
        [--image-size 64] [--repo PATH] [--json PATH]

Runs the real entry point, `torchrun --nproc_per_node=N -m rebm.eval.evaluate CONFIG ... --samples
--no-ece` with FID (`image_log.log_fid`), once per sample count, each in a fresh process tree, and
reports the peak resident memory of every rank (VmHWM, polled from /proc: Linux). The setting: a fake CIFAR-10 in the real on-disk format resized to
`--image-size` px, a random WideResNet-10-1, 1 PGD step per sample, 100 samples per rank and
batch, the REBM_FID_FEATURES stand-in feature network of the tests (15-d, so the numbers are the
samples' memory, not Inception's) and its reference statistics from `rebm.eval.fid_stats`.
Bounded-memory sample evaluation shows the same peak at both counts; gathering every sample on
every rank adds N x 3 x S x S x 4 bytes (and all-gather buffers) per rank.

`--repo PATH` runs another checkout's rebm (e.g. the code before a change) on the same data.
Prints one JSON object per sample count and a summary table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STANDIN = "rebm.eval.standin:features"


def _env(repo: Path) -> dict:
    env = dict(os.environ)
    # rebm from `repo`; the stand-in feature network and the fake data writer from this checkout
    env["PYTHONPATH"] = os.pathsep.join([str(repo), str(REPO)])
    env.update(REBM_FID_FEATURES=STANDIN, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    return env


def _prepare(folder: Path, repo: Path, image_size: int) -> list:
    """Fake CIFAR-10, a random checkpoint, the stand-in reference statistics; the overrides."""
    code = ("import sys, torch; from rebm.standin.writers import write_fake_cifar10; "
            "from rebm.models import build_model; "
            "write_fake_cifar10(sys.argv[1], n_train=64, n_test=10); torch.manual_seed(0); "
            "torch.save(build_model('WideResNet10x1', 10).state_dict(), sys.argv[1] + '/model.pth')")
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True, env=_env(repo),
                   cwd=folder)
    (folder / "config.yaml").write_text("rand_seed: 0\n")
    overrides = [
        "data.indist_dataset=cifar10", f"data.indist_ds_dir={folder}", "data.num_workers=0",
        f"data.image_size={image_size}", "model.model_type=WideResNet10x1",
        f"model.ckpt_path={folder / 'model.pth'}", "robust_eval=false",
        "per_device_eval_batch_size=100", "image_log.num_steps=1", "image_log.step_size=0.5",
        "image_log.log_fid=true", f"image_log.data_dir={folder / 'stats.npz'}",
        "wandb_mode=disabled",
    ]
    subprocess.run([sys.executable, "-m", "rebm.eval.fid_stats", str(folder / "config.yaml"),
                    *overrides, "--out", str(folder / "stats.npz")], check=True, env=_env(repo),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=folder)
    return overrides


def _tree(pid: int) -> list:
    """pid and its descendants (Linux /proc)."""
    found = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            children = [int(c) for c in fh.read().split()]
    except OSError:
        return found
    for child in children:
        found += _tree(child)
    return found


def _peak_kib(pid: int) -> tuple:
    """(VmHWM in KiB, command line) of a process; (0, "") once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            hwm = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM"))
        with open(f"/proc/{pid}/cmdline") as fh:
            return hwm, fh.read().replace("\0", " ")
    except (OSError, StopIteration):
        return 0, ""


def peak_per_rank(cmd: list, env: dict) -> tuple:
    """Run `cmd`; poll every process of its tree for its peak RSS (VmHWM, monotonic, so a poll
    every 0.1 s misses at most the growth of a rank's last 0.1 s). Returns (exit code, {pid:
    peak KiB} of the evaluation ranks, seconds, last stdout line)."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        # cwd: outside any checkout, so `-m rebm...` imports the rebm of PYTHONPATH
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                cwd=tempfile.gettempdir())
        peaks: dict = {}
        while proc.poll() is None:
            for pid in _tree(proc.pid):
                hwm, command = _peak_kib(pid)
                if "rebm.eval.evaluate" in command and "torch.distributed.run" not in command:
                    peaks[pid] = max(peaks.get(pid, 0), hwm)
            time.sleep(0.1)
        out.seek(0)
        lines = out.read().strip().splitlines()
    return proc.returncode, peaks, time.perf_counter() - started, lines


def measure(folder: Path, repo: Path, overrides: list, samples: int, nproc: int) -> dict:
    """One evaluation in a fresh process tree: the peak RSS of each rank and the result."""
    run_dir = folder / f"eval_{samples}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "rebm.eval.evaluate", str(folder / "config.yaml"),
           *overrides, f"image_log.num_samples={samples}", f"run_dir={run_dir}", "--samples",
           "--no-ece"]
    code, peaks, seconds, lines = peak_per_rank(cmd, _env(repo))
    if code != 0:
        raise SystemExit(f"evaluation with {samples} samples failed:\n" + "\n".join(lines[-30:]))
    metrics = json.loads(lines[-1])
    fid = metrics.get("fid_standin", metrics.get("fid"))
    ranks = [round(peaks[pid] / 1024, 1) for pid in sorted(peaks)]
    return {"repo": str(repo), "samples": samples, "nproc": nproc, "peak_rss_mib": max(ranks),
            "peak_rss_mib_per_rank": ranks, "seconds": round(seconds, 1), "fid": fid}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench_eval_memory.py", description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[2000, 8000])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout whose rebm runs")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_eval_memory_") as tmp:
        folder = Path(tmp)
        started = time.perf_counter()
        overrides = _prepare(folder, args.repo.resolve(), args.image_size)
        for samples in args.samples:
            rows.append(measure(folder, args.repo.resolve(), overrides, samples, args.nproc))
            print(json.dumps(rows[-1]), flush=True)
    low, high = rows[0], rows[-1]
    growth = high["peak_rss_mib"] / low["peak_rss_mib"] - 1
    print(f"# {args.nproc} ranks, {args.image_size} px: peak RSS per rank "
          + ", ".join(f"{r['samples']} samples {r['peak_rss_mib']:.0f} MiB" for r in rows)
          + f"; {growth:+.1%} from {low['samples']} to {high['samples']} samples "
          f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "growth": growth}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
