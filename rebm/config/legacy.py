"""Fields of the original DAT configs that rebm accepts but does not use.

They live here, as bases of the config sections, so that old experiment files load unchanged
while the sections in schema.py list only what rebm reads. A legacy field set to a non-default
value is reported once at start-up (`ignored_fields_set`); nothing else reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import Any, List, Optional, Set

from rebm.config.frozen import Frozen, explicit_keys


@dataclass
class LegacyAttackFields(Frozen):
    fixed_steps: Optional[int] = None  # original field, unused
    lr: Optional[float] = None  # Adam-attack step of the original, unused


@dataclass
class LegacyImageLogFields(Frozen):
    attack_type: str = "pgd"  # original field, unused (generation is PGD)
    ood_data_dir: Optional[str] = None  # original field, unused
    img_extension: Optional[str] = None  # original field, unused
    save_dir: Optional[str] = None  # original field, unused (grids go to <run_dir>/samples)
    target_class: Optional[int] = None  # original field, unused
    lr: Optional[float] = None  # original field, unused


@dataclass
class LegacyDataFields(Frozen):
    mixed_id: bool = False  # original field, unused


@dataclass
class LegacyModelFields(Frozen):
    which_logit: str = "first"  # original field (logit choice of its binary models), unused
    model_prefix: str = ""  # original ConvNext field, unused
    drop_path_rate: float = 0.1  # original ConvNext field, unused
    head_init_scale: float = 1.0  # original ConvNext field, unused
    model_id: str = "convnextv2_base"  # original ConvNext field, unused


@dataclass
class LegacyTrainFields(Frozen):
    r1_indist_weight: float = 1.0  # original field, unused (R1 acts on x_in)
    r1_outdist_weight: float = 0.0  # original field, unused
    r1_adv_weight: float = 0.0  # original field, unused
    tinyimages_loader: str = "innout"  # original field, unused
    indist_clean_extra: bool = False  # original field, unused
    indist_perturb: bool = False  # original field, unused
    indist_perturb_steps: int = 10  # original field, unused
    indist_perturb_eps: float = 0.5  # original field, unused
    mixup_alpha: float = 5  # original field, unused
    mixup_beta: float = 1  # original field, unused
    indist_train_only: bool = False  # original field, unused
    eval_only: bool = False  # original field, unused (use python -m rebm.eval.evaluate)
    use_counterfactuals: bool = False  # original field, unused
    evaluate_ood_detection: bool = False  # original field, unused (rebm.eval.evaluate --ood)
    ood_detection_logsumexp: bool = False  # original field, unused
    outdist_dataset_ood_detection: str = "noise"  # original field, unused
    config_path: Optional[str] = None  # original field, unused


LEGACY_BASES = (LegacyAttackFields, LegacyImageLogFields, LegacyDataFields, LegacyModelFields,
                LegacyTrainFields)


def legacy_names(cls: type) -> Set[str]:
    """Names of the fields `cls` inherits from a legacy base."""
    return {f.name for base in cls.__mro__ if base in LEGACY_BASES for f in fields(base)}


def legacy_keys(cfg_cls: type, prefix: str = "") -> Set[str]:
    """Dotted keys of every legacy field of a config class and its sections."""
    keys = {prefix + name for name in legacy_names(cfg_cls)}
    for f in fields(cfg_cls):
        section = f.default_factory() if callable(f.default_factory) else None  # type: ignore[misc]
        if is_dataclass(section):
            keys |= legacy_keys(type(section), prefix + f.name + ".")
    return keys


def ignored_fields_set(cfg: Any) -> List[str]:
    """Legacy fields the config file or the command line set (reported once at start-up)."""
    legacy = legacy_keys(type(cfg))
    return [key for key in explicit_keys(cfg) if key in legacy]


def ignored_fields_notice(cfg: Any) -> Optional[str]:
    """One line naming the legacy fields the config sets (None when it sets none)."""
    keys = ignored_fields_set(cfg)
    if not keys:
        return None
    return (f"config fields accepted for compatibility, without effect (docs/configs.md says "
            f"why): {', '.join(keys)}")
