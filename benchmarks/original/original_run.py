"""One whole run of the original DAT code (github:xuwangyin/DAT at fb2ffc7) for the run-level
twin (benchmarks/original/run_twin.py): its own `rebm.training.train.train`, its own loaders
and augmentations reading the twin's files, its own evaluation, unchanged but for what cannot
run here.

    python benchmarks/original/original_run.py ORIGINAL_CHECKOUT CONFIG_YAML RESULT_JSON

The process runs in the run's folder (the original reads its TinyImages exclusion lists from
./InNOutRobustness/TinyImagesExclusionIdcs/, which the twin writes there). Replaced, and why:
- pytorch-fid's `calculate_fid_given_paths` and the Inception Score: their Inception weights
  cannot be downloaded here. The replacement reads the PNG folder compute_fid has just written
  (the samples of that evaluation) into a file; the FID of every side's samples is computed
  after the runs by one feature network (run_data.FeatureNetwork), so it returns NaN and the
  original's loop writes no model_bestfid.pth (the twin picks that step from the stored FIDs by
  the original's rule, the first strictly smaller);
- TinyImages' record count, the module constant TINY_LENGTH (79,302,017): the twin's file has
  the same layout and fewer records;
- torchvision's MD5 check of the CIFAR-10 archive (download=True): the twin's files are in
  CIFAR's format but are not the official release;
- the model name WideResNet10x1, which the original's model file lacks (timm_shim adds it with
  the original's own WideResNet class).
What the loop computes is recorded by wrapping the functions it calls (values passed through).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

ORIGINAL = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else None
if ORIGINAL:  # before anything imports a `rebm`
    sys.path.insert(0, ORIGINAL)

import numpy as np  # noqa: E402
import timm_shim  # noqa: E402  (benchmarks/original/timm_shim.py: this script's own folder)
import torch  # noqa: E402


def install_replacements(record: dict, samples_folder: str) -> None:
    import InNOutRobustness.utils.datasets as datasets
    import InNOutRobustness.utils.datasets.tinyImages as tiny_images
    import rebm.eval.eval_utils as eval_utils
    import torchvision.datasets.cifar
    from PIL import Image

    def tinyimages_dataset(path, *args, **kwargs):
        tiny_images.TINY_LENGTH = os.path.getsize(path) // 3072
        return dataset_class(path, *args, **kwargs)

    dataset_class = tiny_images.TinyImagesDataset
    datasets.TinyImagesDataset = tinyimages_dataset  # what rebm/training/data.py calls
    torchvision.datasets.cifar.check_integrity = lambda path, md5=None: os.path.isfile(path)

    def keep_samples(paths, **kwargs):
        folder = paths[0]
        files = sorted(f for f in os.listdir(folder) if f.endswith(".png"))
        pixels = np.stack([np.asarray(Image.open(os.path.join(folder, f)).convert("RGB"))
                           for f in files])
        path = os.path.join(samples_folder, f"samples_step{record['evaluating']:08d}.npy")
        np.save(path, pixels)
        return float("nan")

    eval_utils.calculate_fid_given_paths = keep_samples
    eval_utils.compute_inception_score = lambda **kw: (float("nan"), float("nan"))


def install_recorders(record: dict) -> None:
    """Wrap what the loop calls, to record T and the AUC of each step, and each evaluation."""
    import rebm.training.modeling as modeling
    import rebm.training.train as original_train

    compute_ebm, evaluate_fid = original_train.compute_ebm_metrics, original_train.evaluate_and_log_fid
    evaluate_accuracy = original_train.evaluate_and_log_accuracy
    save_bestacc = modeling.save_best_accuracy_model

    def ebm_metrics(**kw):
        metrics = compute_ebm(**kw)
        record["steps"].append({"T": kw["outdist_step"], "adv_auc": float(metrics.adv_auc)})
        return metrics

    def fid(model, cfg, metrics, global_step):
        record["evaluating"] = global_step - 1  # updates done before this evaluation
        return evaluate_fid(model, cfg, metrics, global_step)

    def accuracy(model, cfg, loader, metrics, global_step):
        evaluate_accuracy(model, cfg, loader, metrics, global_step)
        record["evaluations"].append({"step": global_step - 1, "test_acc": metrics.test_acc,
                                      "robust_test_acc": metrics.robust_test_acc})

    def bestacc(model):
        record["bestacc_writes"].append(record["evaluating"])
        return save_bestacc(model)

    original_train.compute_ebm_metrics, original_train.evaluate_and_log_fid = ebm_metrics, fid
    original_train.evaluate_and_log_accuracy = accuracy
    modeling.save_best_accuracy_model = bestacc


def main() -> None:
    import wandb

    config_path, result_path = sys.argv[2], sys.argv[3]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    bridged = timm_shim.install()
    from rebm.training.config_classes import load_train_config

    import rebm.training.train as original_train

    cfg = load_train_config(config_path)
    cfg.attack.eps = cfg.image_log.eps = math.inf
    folder = os.path.dirname(os.path.abspath(result_path))
    record = {"steps": [], "evaluations": [], "bestacc_writes": [], "evaluating": -1,
              "bridged": bridged}
    install_replacements(record, folder)
    install_recorders(record)
    # as its entry point does with wandb_disabled (no network, nothing uploaded)
    wandb.init(mode="disabled", project=cfg.wandb_project, dir=cfg.wandb_dir)
    torch.backends.cudnn.benchmark = True
    started = time.perf_counter()
    original_train.train(cfg)
    record["seconds"] = time.perf_counter() - started
    record.pop("evaluating")
    with open(result_path, "w") as fh:
        json.dump(record, fh)


if __name__ == "__main__":
    main()
