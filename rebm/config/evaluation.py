"""The `eval.*` section: how a model is evaluated (docs/evaluation.md). None of it changes what a
run trains (`eval` is one of identity.RUN_KEYS), so a run can be re-evaluated differently.

Validated by `validate_evaluation` (called from loading.validate): metric names are checked
against the evaluation registry when it is evaluated, not here (rebm.config sits below
rebm.eval).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from rebm.config.errors import ConfigError
from rebm.config.evaluation_ood import OODCounterfactualFields, validate_ood_counterfactuals

PR_REFERENCE_SPLITS = ("train", "test")
SAMPLE_PIXELS = ("floor", "round")
IS_RESIZES = ("pil", "fidelity")


@dataclass
class EvalConfig(OODCounterfactualFields):
    """Evaluation of a model: which test images, which extra metrics, how samples are drawn."""

    metrics: List[str] = field(default_factory=list)  # metrics added to every evaluation (training's and rebm.eval.evaluate's), names of rebm.eval.registry, e.g. [inception_score, precision_recall]
    image_ids: Optional[str] = None  # file of test images to evaluate on, one per line: a 0-based index or a path relative to the split folder (ImageNet: wnid/ILSVRC2012_val_….JPEG); robustbench: RobustBench's 5000 ImageNet val images; null: the whole split
    num_images: Optional[int] = None  # evaluate on the first N test images (of image_ids when set); null: all
    unconditional_samples: Optional[bool] = None  # samples ascend logsumexp_k f_k instead of f_y (unconditional FID / IS); null: as logsumexp_sampling (the original's compute_fid), true/false: always/never
    grid_num_samples: int = 100  # most images in the sample and seed grids: the first 10 samples of each of the first ceil(n / 10) classes, 10 a row (100: the original's grid)
    pr_reference_split: str = "train"  # precision/recall: in-distribution split of the real images
    pr_num_real: Optional[int] = None  # precision/recall: real images of the reference; null: as many as samples
    pr_reference: Optional[str] = None  # precision/recall: reference batch, an .npz in OpenAI's format (arr_0, uint8 N x H x W x 3); null: a seeded class-balanced random subset of pr_reference_split
    sample_pixels: str = "floor"  # 8-bit pixels of the samples (FID, IS, P-R, PNG/npz files): floor (floor(255 x), the original's to_pil_image) or round
    robust_eval: bool = True  # evaluate robust accuracy (PGD with indist_attack_clf)
    robust_eval_steps: Optional[int] = None  # PGD steps of robust evaluation (default: K)
    per_device_eval_batch_size: Optional[int] = None  # eval images per rank and batch; default min(batch_size, 3 x micro-batch)
    keep_samples: bool = False  # also write every generated sample as a PNG under samples/step_<N>/
    is_resize: str = "pil"  # Inception Score input: pil (8-bit samples resized to 299 px by PIL, the original's path) or fidelity (torch-fidelity's own resize)


def validate_evaluation(cfg, source: str = "config") -> None:
    """Ranges of the `eval.*` fields; raises ConfigError naming the key."""
    ev: EvalConfig = cfg.eval
    for key, choices in (("sample_pixels", SAMPLE_PIXELS), ("is_resize", IS_RESIZES)):
        if getattr(ev, key) not in choices:
            raise ConfigError(f"{source}: 'eval.{key}: {getattr(ev, key)}' is not valid; use one "
                              f"of {', '.join(choices)}")
    if ev.pr_reference_split not in PR_REFERENCE_SPLITS:
        raise ConfigError(f"{source}: 'eval.pr_reference_split: {ev.pr_reference_split}' is "
                              f"not valid; use one of {', '.join(PR_REFERENCE_SPLITS)}")
    for key in ("num_images", "pr_num_real"):
        value = getattr(ev, key)
        if value is not None and value < 1:
            raise ConfigError(f"{source}: 'eval.{key}' must be a positive integer or null, "
                                  f"got {value}")
    if ev.grid_num_samples < 0:
        raise ConfigError(f"{source}: 'eval.grid_num_samples' must be >= 0, "
                              f"got {ev.grid_num_samples}")
    if not all(isinstance(name, str) and name for name in ev.metrics):
        raise ConfigError(f"{source}: 'eval.metrics' must be a list of metric names")
    validate_ood_counterfactuals(ev, source)
