"""The registered ImageNet models in timm's own terms, for the tests that build timm's network
next to rebm's and compare them (rebm/models/timm_families.py holds the registrations)."""

from __future__ import annotations

from typing import Any, Dict, Optional

from rebm.models.timm_families import CONVNEXTS, RESNETS


def timm_name(model_type: str) -> Optional[str]:
    """timm's registered name of the same network (None: timm has none)."""
    entry = RESNETS.get(model_type) or CONVNEXTS.get(model_type)
    return entry[0] if entry else None


def timm_arguments(model_type: str) -> Dict[str, Any]:
    """The timm constructor arguments (ResNet or ConvNeXt) of a registered ImageNet model,
    without rebm's options: `timm.models.resnet.ResNet(block=Bottleneck, **these)`."""
    if model_type in RESNETS:
        return dict(RESNETS[model_type][1])
    args = dict(CONVNEXTS[model_type][1])
    args.pop("convstem_three_convs", None)
    return args
