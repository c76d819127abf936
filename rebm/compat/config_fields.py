"""Fields of the original DAT configs that rebm accepts although they do nothing here: the
original's experiment files load unchanged (rebm/config/legacy.py applies these declarations).

Serves: loading every config file of the original DAT code (xuwangyin/DAT, rebm/training/
config_classes.py) without an edit. Each field says what the original did with it (file:function
of its code) in its metadata, which docs/configs.md prints:
- `ignored(...)`: it had no effect in the original either; setting it is reported in one line
  at start-up;
- `refused(...)`: it had an effect that rebm does not offer; any value but the accepted ones is
  a one-line error at load, the accepted ones do nothing and are reported like the ignored ones.
They are plain dataclasses, the bases of the config sections of rebm/config/schema.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Tuple


def ignored(default: Any, why: str) -> Any:
    """A field without effect in the original (`why` says where it went)."""
    return field(default=default, metadata={"why": why})


def refused(default: Any, why: str, accepted: Tuple[Any, ...] = ()) -> Any:
    """A field whose other values had an effect rebm does not offer; `default` (and `accepted`)
    are the values that do nothing."""
    return field(default=default, metadata={"why": why, "accepted": (default, *accepted)})


_ADAM = "rebm/eval/eval_utils.py:generate_images"
_NOWHERE = "read nowhere by its training code (rebm/training/train.py, metrics.py)"


@dataclass
class LegacyAttackFields:
    fixed_steps: Optional[int] = ignored(None, f"passed on to {_ADAM}, which does not use it; "
                                         "for indist_attack_clf only asserted equal to max_steps "
                                         "(rebm/training/metrics.py:compute_clf_adv_loss)")
    lr: Optional[float] = ignored(None, f"step of the Adam attack ({_ADAM}, attack_type: adam), "
                                  "which rebm does not have (attack_type is pgd only)")


@dataclass
class LegacyImageLogFields:
    attack_type: str = refused("pgd", f"adam generates the samples by Adam steps ({_ADAM}); "
                               "rebm generates by PGD only")
    img_extension: Optional[str] = refused(
        None, "file format of the samples it writes for pytorch-fid "
        "(rebm/eval/eval_utils.py:compute_fid); rebm's FID takes the 8-bit pixels a PNG of the "
        "sample stores (eval.sample_pixels), and a lossy format would change the FID",
        accepted=("png",))
    save_dir: Optional[str] = ignored(None, "folder of the temporary sample files and grids "
                                      "(rebm/eval/eval_utils.py:compute_fid); rebm writes grids "
                                      "to <run_dir>/samples")
    target_class: Optional[int] = refused(
        None, "older versions draw every sample from this class and skip FID "
        "(rebm/eval/eval_utils.py:compute_fid); its newest ImageLogConfig has no such field")
    lr: Optional[float] = ignored(None, f"step of the Adam generation ({_ADAM}, attack_type: "
                                  "adam, refused)")


@dataclass
class LegacyDataFields:
    mixed_id: bool = ignored(False, "required by its DataConfig, read nowhere "
                             "(rebm/training/data.py)")


_CONVNEXT = ("a field of its ConvNextConfig that rebm/training/modeling.py:get_model "
             "never passes to timm's convnext_*")


@dataclass
class LegacyModelFields:
    which_logit: str = ignored("first", "a field of its BaseModelConfig read nowhere "
                               "(rebm/training/modeling.py:get_model)")
    model_prefix: str = ignored("", _CONVNEXT)
    drop_path_rate: float = ignored(0.1, _CONVNEXT + " (timm's default, 0, applies there as in "
                                    "rebm)")
    head_init_scale: float = ignored(1.0, _CONVNEXT + " (timm's default is 1.0)")
    model_id: str = ignored("convnextv2_base", _CONVNEXT)


_OOD = "rebm/eval/eval_ood_detection.py, eval_utils.py:ood_detection"


@dataclass
class LegacyTrainFields:
    r1_indist_weight: float = ignored(1.0, _NOWHERE + "; R1 acts on x_in with weight r1reg "
                                      "(metrics.py:compute_ebm_metrics)")
    r1_outdist_weight: float = ignored(0.0, _NOWHERE)
    r1_adv_weight: float = ignored(0.0, _NOWHERE)
    tinyimages_loader: str = refused("innout", "rebm/training/data.py:get_tinyimages_dataset "
                                     "raises on anything but innout, the In-N-Out loader")
    indist_clean_extra: bool = ignored(False, _NOWHERE)
    indist_perturb: bool = refused(False, "true perturbs x_in by PGD descent on f_y (radius "
                                   "indist_perturb_eps, indist_perturb_steps steps of "
                                   "attack.step_size) before the energy loss "
                                   "(metrics.py:compute_ebm_metrics); rebm does not")
    indist_perturb_steps: int = ignored(10, "read only with indist_perturb: true (refused)")
    indist_perturb_eps: float = ignored(0.5, "read only with indist_perturb: true (refused)")
    mixup_alpha: float = ignored(5, _NOWHERE)
    mixup_beta: float = ignored(1, _NOWHERE)
    indist_train_only: bool = ignored(False, _NOWHERE)
    eval_only: bool = ignored(False, _NOWHERE + " (evaluation: python -m rebm.eval.evaluate)")
    use_counterfactuals: bool = ignored(False, _NOWHERE)
    evaluate_ood_detection: bool = ignored(False, _NOWHERE + " (OOD detection: python -m "
                                           "rebm.eval.evaluate --ood)")
    ood_detection_logsumexp: bool = refused(
        False, f"true scores its OOD evaluation by logsumexp instead of max-softmax "
        f"({_OOD}); rebm's evaluate --ood takes the score from `logsumexp`")
    outdist_dataset_ood_detection: str = refused(
        "noise", f"the out-distribution of its OOD evaluation ({_OOD}); rebm's "
        "evaluate --ood scores data.outdist_dataset")
    config_path: Optional[str] = ignored(None, "named the counterfactual folder of older "
                                         "versions; not a field of its newest TrainConfig")


# Keys of a section that serves two keys of the file (AttackConfig: `attack`, `indist_attack_clf`)
# that only one of them reads; the other had no effect in the original either. It cannot be a
# legacy field (the class's field has an effect under the other key), so it is declared by its
# file key. Which keys a run reads is checked by tests/test_fields_read.py.
KEYS_WITHOUT_EFFECT = {
    "indist_attack_clf.start_step": "only asserted equal to indist_attack_clf.max_steps "
                                    "(rebm/training/metrics.py:compute_clf_adv_loss), whose "
                                    "PGD takes max_steps steps; in rebm too",
}

LEGACY_BASES = (LegacyAttackFields, LegacyImageLogFields, LegacyDataFields, LegacyModelFields,
                LegacyTrainFields)
