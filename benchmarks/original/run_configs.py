"""The run-level twin's recipe, written for each code: the CIFAR-10 DAT recipe's stage 2
(experiments/cifar10/cifar10-dat-WideResNet34x10-T40-seed0.yaml, the original's
experiments/cifar10/..._seed1.yaml) with the model, the cap on T, the AUC window, the number of
samples and the intervals scaled down to a CPU (WideResNet-10-1, batch 16, T capped at 4, an
AUC window of 64 images, 50 samples, an evaluation every 800 images, 2 epochs of the 1,438
digits); every rule (the curriculum, the attacks' form,
EMA, augmentations, the evaluation schedule and the best-model rules) is the recipe's.

This module imports nothing of either `rebm` (the original's process loads it by path).
"""

from __future__ import annotations

import math
import os

# What is scaled, and to what. The recipe: WideResNet-34-10, batch 128, T capped at 50 steps of
# 0.1, K = 10 steps of 0.1 in an L2 ball of 0.5, AUC window 1,000 images at a threshold of 0.8,
# 32 sampling steps of 0.2 from 10,000 seeds, evaluation every 50,000 images, SGD lr 0.001.
RUN = dict(
    model="WideResNet10x1", batch_size=16, total_epochs=2,
    T_cap=4, attack_step_size=0.1, K=10, clf_step_size=0.1, clf_eps=0.5,
    auc_threshold=0.8, window_images=64, lr=0.001, wd=5e-4,
    sample_steps=32, sample_step_size=0.2, num_samples=50, evaluation_images=800,
    tinyimages_records=3000, stage1_steps=300, seed=0,
)


def steps_per_epoch(spec: dict, train_images: int) -> int:
    """Both codes drop the last incomplete batch of an epoch."""
    return train_images // spec["batch_size"]


def evaluation_steps(spec: dict, total_steps: int) -> list:
    """Updates done before each evaluation, by the original's rule (should_trigger_event at the
    start of step k, counted from 1: k = 1 and each k whose images cross a multiple of the
    interval); its loop stops before the step after its last, so k <= total_steps."""
    B, interval = spec["batch_size"], spec["evaluation_images"]
    return [k - 1 for k in range(1, total_steps + 1)
            if k == 1 or ((k - 1) * B) // interval < (k * B) // interval]


def rebm_overrides(spec: dict, files: dict, seed: int, run_dir: str) -> list:
    """rebm's command line: the recipe file, then the scaled values and the twin's files."""
    return [
        "data.indist_dataset=cifar10-conditional", f"data.indist_ds_dir={files['indist']}",
        "data.outdist_dataset=tinyimages", f"data.outdist_std_dir={files['tinyimages']}",
        f"data.tinyimages_exclusion_dir={files['exclusion']}", "data.num_workers=1",
        "data.num_classes=10", "data.image_size=32",
        f"model.model_type={spec['model']}", f"model.ckpt_path={files['stage1']}",
        "model.compile=false",
        f"attack.max_steps={spec['T_cap']}", f"attack.step_size={spec['attack_step_size']}",
        f"indist_attack_clf.max_steps={spec['K']}", f"indist_attack_clf.start_step={spec['K']}",
        f"indist_attack_clf.step_size={spec['clf_step_size']}",
        f"indist_attack_clf.eps={spec['clf_eps']}",
        f"image_log.num_steps={spec['sample_steps']}",
        f"image_log.step_size={spec['sample_step_size']}", "image_log.log_fid=false",
        f"image_log.seed_images={files['seeds']}", f"image_log.num_samples={spec['num_samples']}",
        "eval.metrics=[samples_npz]", f"per_device_eval_batch_size={spec['batch_size']}",
        f"lr={spec['lr']}", f"wd={spec['wd']}", f"batch_size={spec['batch_size']}",
        f"min_imgs_per_threshold={spec['window_images']}", f"AUC_th={spec['auc_threshold']}",
        f"rand_seed={seed}", f"total_epochs={spec['total_epochs']}",
        f"n_imgs_per_metrics_log={spec['batch_size']}",
        f"n_imgs_per_image_log={10**9}", f"n_imgs_per_evaluation_log={spec['evaluation_images']}",
        f"n_imgs_per_ckpt_save={10**9}", "wandb_disabled=true", "wandb_mode=disabled",
        "device=cpu", f"run_dir={run_dir}", "resume=never",
    ]


def original_values(spec: dict, files: dict, seed: int, workdir: str) -> dict:
    """The original's YAML values: its CIFAR-10 experiments file with the same scaled values.
    Its loader reads the seeds file and writes PNGs under image_log.save_dir."""
    B = spec["batch_size"]
    return dict(
        data=dict(indist_dataset="cifar10-conditional", indist_ds_dir=files["indist"],
                  mixed_id=False, outdist_dataset="tinyimages",
                  outdist_std_dir=os.path.join(files["tinyimages"], "tiny_images.bin"),
                  num_workers=1, num_classes=10, image_size=32),
        attack=dict(attack_type="pgd", max_steps=spec["T_cap"], fixed_steps=10, start_step=0,
                    step_size=spec["attack_step_size"], eps=math.inf),
        indist_attack_clf=dict(attack_type="pgd", max_steps=spec["K"], fixed_steps=10,
                               start_step=spec["K"], step_size=spec["clf_step_size"],
                               eps=spec["clf_eps"]),
        model=dict(model_type=spec["model"], ckpt_path=files["stage1"], which_logit="first",
                   normalize_input=True, use_batchnorm=False),
        image_log=dict(attack_type="pgd", num_steps=spec["sample_steps"],
                       step_size=spec["sample_step_size"], eps=math.inf, log_fid=True,
                       data_dir=os.path.join(workdir, "no_fid_statistics.npz"),
                       ood_data_dir=files["seeds"], img_extension="png",
                       num_samples=spec["num_samples"],
                       save_dir=os.path.join(workdir, "original_samples", "pngs")),
        optimizer="sgd", wd=spec["wd"], lr=spec["lr"], r1reg=0.0, batch_size=B,
        AUC_th=spec["auc_threshold"], rand_seed=seed, samples_per_attack_step=None,
        clf_indist_weight=1.0, clf_outdist_weight=0.0, clf_adv_weight=1.0,
        r1_indist_weight=1.0, r1_outdist_weight=0.0, r1_adv_weight=0.0,
        min_imgs_per_threshold=spec["window_images"],
        n_imgs_per_metrics_log=B, n_imgs_per_image_log=10**9,
        n_imgs_per_evaluation_log=spec["evaluation_images"], wandb_project="twin",
        wandb_disabled=True, tags=["twin"], fp16=False, robust_eval=True,
        augm_type_classification="autoaugment_cutout", augm_type_generation="original",
        tinyimages_loader="innout", fixed_lr=True, wandb_dir=workdir, use_ema=True,
        logsumexp=True, keep_samples=True, total_epochs=spec["total_epochs"], use_ddp=False,
    )
