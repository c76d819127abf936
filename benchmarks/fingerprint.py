"""Fingerprints of the numbers a refactor must not change, on this machine:

    .venv/bin/python benchmarks/fingerprint.py OUT_DIR

- the quickstart's stage 1 and stage 2 weights after 30 steps each, 2 processes (torchrun), as a
  sha256 over every tensor of model_final.pth in key order (the file's bytes would also change
  with its folder's name);
- a small paper table over those two checkpoints (accuracy, robust accuracy, ECE, FID, IS,
  precision/recall with the stand-in feature network), its table.csv's sha256 on 1 and on 2
  processes.

It prints one JSON line. Run it at the commit before a change and after it, on the same machine
and with the same OUT_DIR path (bits belong to a machine: docs/design.md §7); OUT_DIR is emptied
first.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
STEPS = ["max_steps=30", "n_imgs_per_evaluation_log=null", "image_log.num_samples=10"]
STANDIN = "rebm.eval.standin:features"


def run(cmd, env) -> None:
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-3000:]}")


def torchrun(args, env) -> None:
    run([os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node=2", *args], env)


def weights_sha256(path: str) -> str:
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = state.get("model", state) if isinstance(state, dict) else state
    digest = hashlib.sha256()
    for key in sorted(state):
        value = state[key]
        if torch.is_tensor(value):
            digest.update(key.encode())
            digest.update(value.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def file_sha256(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def table_yaml(out: str) -> str:
    lines = ["title: fingerprint", "metrics: [accuracy, robust_accuracy, ece, fid, "
             "inception_score, precision_recall]", "batch_size: 16", "overrides:",
             "  - eval.num_images=40", "  - data.num_workers=0", "  - robust_eval_steps=2",
             "  - image_log.num_samples=20", "  - image_log.num_steps=5",
             "  - image_log.log_fid=true", f"  - image_log.data_dir={out}/stats.npz", "rows:",
             "  - name: at", "    group: AT", "    config: experiments/quickstart/digits_stage1.yaml",
             "    checkpoint: stage1/model_final.pth",
             "  - name: dat", "    group: DAT", "    config: experiments/quickstart/digits_stage2.yaml",
             "    checkpoint: stage2/model_final.pth"]
    path = os.path.join(out, "table.yaml")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


def main() -> None:
    out = os.path.abspath(sys.argv[1])
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    stage1, stage2 = os.path.join(out, "stage1"), os.path.join(out, "stage2")
    torchrun(["InNOutRobustnessMean0_cifar100/train_at.py",
              "experiments/quickstart/digits_stage1.yaml", *STEPS, f"run_dir={stage1}"], env)
    torchrun(["-m", "rebm.training.train", "experiments/quickstart/digits_stage2.yaml", *STEPS,
              f"model.ckpt_path={stage1}/model_final.pth", f"run_dir={stage2}"], env)
    standin = {**env, "REBM_FID_FEATURES": STANDIN}
    run([sys.executable, "-m", "rebm.eval.fid_stats", "experiments/quickstart/digits_stage2.yaml",
         "--out", os.path.join(out, "stats.npz")], standin)
    table = table_yaml(out)
    found = {"stage1_weights": weights_sha256(os.path.join(stage1, "model_final.pth")),
             "stage2_weights": weights_sha256(os.path.join(stage2, "model_final.pth"))}
    for nproc in (1, 2):
        folder = os.path.join(out, f"table{nproc}")
        args = ["-m", "rebm.eval.table", table, "--checkpoints", out, "--out", folder]
        if nproc == 1:
            run([sys.executable, *args], standin)
        else:
            torchrun(args, standin)
        found[f"table_csv_{nproc}"] = file_sha256(os.path.join(folder, "table.csv"))
    print(json.dumps(found))


if __name__ == "__main__":
    main()
