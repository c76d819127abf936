"""The audit of the original's defaults: every field of the original DAT code's config classes
(rebm/training/config_classes.py at fb2ffc7) that has a default there, against rebm's, with the
decision. docs/configs.md prints it (rebm/config/docs.py), and tests/test_original_defaults.py
checks the rows that claim equal defaults.

Fields the original requires (no default) are not listed: a config of the original sets them, so
rebm's defaults for them never change one of its numbers. Legacy fields without effect are listed
in their own section of docs/configs.md (rebm/config/legacy.py).
"""

from __future__ import annotations

from typing import Tuple

SAME = "same"

# (key, the original's default, rebm's default, decision)
AUDIT: Tuple[Tuple[str, str, str, str], ...] = (
    ("data.image_size", "256", "256 for ImageNet, 32 otherwise",
     "rebm takes 256 for ImageNet (none of the original's ImageNet configs sets it). The "
     "original reads it only for ImageNet transforms and for seed images from a folder; CIFAR "
     "data and .pt seed files are never resized, so 32 is its effective size there. The field "
     "came in on 2025-10-31 (81f6a54); the original's 224 px models of September 2025 were "
     "trained before it, at 224 px, which `dat_resnet50_224px.yaml` states"),
    ("data.num_classes", "1", "the dataset's (10, 100, 1000)",
     "the original's 1 fails on every multi-class dataset (labels beyond the one logit), so no "
     "config that ran relied on it; unset, rebm takes the dataset's class count"),
    ("model.use_convstem", "true (ConvNextConfig)", "true for ConvNeXt, false otherwise",
     "rebm takes the original's: a ConvNeXt is built with the ConvStem unless the config says "
     "false (the field has no meaning for the other models)"),
    ("use_ema", "false", "false", "rebm takes the original's (it was true); every shipped config "
     "states it"),
    ("image_log.sweep_radius", "3", "3", "rebm takes the original's (it was 5)"),
    ("image_log.blur_kernel_size, adaptive_blur", "0, false", "0, false",
     "same defaults; the original never blurs the FID seeds (its only reader of "
     "blur_kernel_size starts with `assert False`, eval_utils.py:325-330), and rebm's sample "
     "metrics do not either unless `image_log.blur_fid_seeds: true` asks"),
    ("logsumexp_sampling", "false", "false", "same; true also makes the evaluation's samples "
     "unconditional, as the original's compute_fid does (`eval.unconditional_samples: null` "
     "follows it; true/false overrule it, with a notice)"),
    ("attack.step_size, image_log.step_size", "null", "0.1",
     "the original's null fails in its PGD step (a step of None), so no config that ran relied "
     "on it"),
    ("attack.eps, indist_attack_clf.eps, image_log.eps", "null", "inf (indist_attack_clf: 0.5)",
     "the original's null fails in its projection, so no config that ran relied on it; "
     "indist_attack_clf is required there"),
    ("fixed_lr", "false", "true", "the original refuses false at load (`fixed_lr must be True`); "
     "rebm refuses false too, so only the default differs and a config without it runs"),
    ("use_ddp, ddp_backend", "false, nccl", "true, auto",
     "no number changes: DDP gives the numbers of one process (docs/design.md)"),
    ("wandb_dir", "./", "the run directory", "where files go; no number changes"),
    ("model.normalize_input, use_batchnorm, use_layernorm, which_logit", "true, false, true, first",
     SAME, SAME),
    ("attack.norm, image_log.norm", "L2", SAME, SAME),
    ("image_log.adaptive_steps, sweep_num_samples", "false, 500", SAME, SAME),
    ("augm_type_classification, augm_type_generation", "autoaugment_cutout, original", SAME, SAME),
    ("logsumexp, robust_eval, keep_samples, track_r1", "true, true, false, false", SAME, SAME),
    ("samples_per_attack_step, n_imgs_per_evaluation_log, total_epochs", "null", SAME, SAME),
    ("openimages_max_samples, openimages_augm, resume_from_state", "null", SAME, SAME),
)


def render_audit() -> list:
    """The audit as Markdown lines (a section of docs/configs.md)."""
    lines = ["## The original's defaults", "",
             "Every field with a default in the original's `rebm/training/config_classes.py` "
             "(fb2ffc7), against rebm's. Where a difference would change a number, rebm takes "
             "the original's value. Fields the original requires are not listed (its configs set "
             "them); its fields without effect are marked *ignored* above.", "",
             "| field | original | rebm | decision |", "|---|---|---|---|"]
    lines += [f"| `{key}` | {orig} | {rebm} | {why} |" for key, orig, rebm, why in AUDIT]
    return lines + [""]
