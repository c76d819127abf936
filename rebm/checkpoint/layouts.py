"""Layouts of public robust ImageNet checkpoints that keep a normaliser next to the network.

  - the `robustness` library (Madry lab; Salman et al.'s robust ResNet-50 / WideResNet-50-x
    files): `{'model': {'module.model.*', 'module.attacker.model.*', 'module.normalizer.new_mean',
    'module.normalizer.new_std', 'module.attacker.normalize.*'}, 'epoch', 'optimizer', ...}`.
    The weights are `model.*`; `attacker.model.*` is the same network again (the attacker's
    reference to it) and is dropped; the normaliser's statistics are checked against the model's.
  - a normalising Sequential (Singh et al.'s `normalize_model`, also RobustBench's):
    `normalize.mean`, `normalize.std`, `model.*`, usually under `module.`. Their ConvStem files
    written without that wrapper (`add_normalization` off, e.g. ConvNeXt-L-CvSt) are plain state
    dicts `stem.stem.<i>.*`, `stages.*`, `head.*`, possibly under `module.` / `base_model.`.

timm's own files are plain state dicts (or `{'state_dict', 'state_dict_ema', 'args', ...}` from its
training script), read by weights.py without anything here.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from rebm.errors import UserError

Normaliser = Tuple[torch.Tensor, torch.Tensor]  # (mean, std), flat


class NormaliserMismatch(UserError, RuntimeError):
    """A checkpoint normalises its inputs differently from the model it is loaded into."""


# (heads that mark the layout, name in the load report, the weights' head, normaliser keys)
_LAYOUTS = (
    ({"model", "attacker", "normalizer"}, "robustness", "model",
     ("normalizer.new_mean", "normalizer.new_std")),
    ({"model", "normalize"}, "normalize+model", "model", ("normalize.mean", "normalize.std")),
)


def split_normaliser(sd: Dict[str, Any], target: Set[str],
                     trail: List[str]) -> Tuple[Dict[str, Any], Optional[Normaliser]]:
    """If `sd` (wrapper prefixes already stripped) is one of the layouts above and its names do
    not already fit `target`: (the network's weights, the file's (mean, std)); otherwise
    (sd, None). Appends the layout's name to `trail`."""
    if set(sd) == target or any("." not in k for k in sd):
        return sd, None
    heads = {k.split(".", 1)[0] for k in sd}
    if heads == {"model"}:  # a wrapper's network alone, without its normaliser
        trail.append("model.")
        return {k[len("model."):]: v for k, v in sd.items()}, None
    for marks, name, keep, (mean_key, std_key) in _LAYOUTS:
        if "model" in heads and heads <= marks and mean_key in sd and std_key in sd:
            trail.append(f"{name} ({keep}.*)")
            weights = {k[len(keep) + 1:]: v for k, v in sd.items() if k.startswith(keep + ".")}
            return weights, (sd[mean_key].flatten().float(), sd[std_key].flatten().float())
    return sd, None


def check_normaliser(model: torch.nn.Module, normaliser: Normaliser, path: str,
                     atol: float = 1e-5) -> None:
    """The file's normaliser must be the model's: a model without `normalize_input` (or with
    other statistics) would see differently scaled inputs than the weights were trained on."""
    mean, std = normaliser
    shown = (f"mean {[round(v, 4) for v in mean.tolist()]}, "
             f"std {[round(v, 4) for v in std.tolist()]}")
    if not getattr(model, "normalize_input", False):
        raise NormaliserMismatch(
            f"checkpoint '{path}' normalises its inputs ({shown}) but the model does not; "
            f"set model.normalize_input=true")
    own_mean = model.mean.detach().flatten().float().cpu()
    own_std = model.std.detach().flatten().float().cpu()
    if (own_mean.shape != mean.shape or not torch.allclose(own_mean, mean, atol=atol)
            or not torch.allclose(own_std, std, atol=atol)):
        raise NormaliserMismatch(
            f"checkpoint '{path}' normalises its inputs with {shown}, the model with mean "
            f"{[round(v, 4) for v in own_mean.tolist()]}, std "
            f"{[round(v, 4) for v in own_std.tolist()]}; use a data.indist_dataset with the "
            f"checkpoint's statistics")
