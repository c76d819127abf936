"""The timm families (ResNet, ConvNeXt): the ImageNet models of the original DAT code, registered
by its names and built from timm.

    ResNet50ImageNet, WideResNet50x2ImageNet, WideResNet50x4ImageNet  (timm's resnet50,
        wide_resnet50_2, and its ResNet class at base width 256: timm has no wide_resnet50_4
        entry, the `robustness` library's WideResNet-50-4 is that network)
    convnext_tiny, convnext_small, convnext_base, convnext_large  (timm's ConvNeXt; with
        `use_convstem` the stem of Singh et al.)

Two tiny members of the same families, `TinyResNetImageNet` and `convnext_test`, exist for tests
and quick CPU runs; they are not models anyone trains for results.

Registration needs no torch or timm: the builders import `_timm_nets` when called, so validating a
config stays cheap. The ConvNeXts declare their own `model.*` options, `use_convstem` and
`use_layernorm`.
"""

from __future__ import annotations

from typing import Any, Dict

from rebm.models.registry import register

# name -> (timm model name or None, ResNetImageNet keyword arguments)
RESNETS: Dict[str, tuple] = {
    "ResNet50ImageNet": ("resnet50", dict(layers=(3, 4, 6, 3))),
    "WideResNet50x2ImageNet": ("wide_resnet50_2", dict(layers=(3, 4, 6, 3), base_width=128)),
    "WideResNet50x4ImageNet": (None, dict(layers=(3, 4, 6, 3), base_width=256)),
    "TinyResNetImageNet": (None, dict(layers=(1, 1, 1, 1), channels=(8, 16, 32, 64),
                                      stem_width=8)),
}

# model.* fields the ConvNeXt builders take besides the common ones
CONVNEXT_OPTIONS = ("use_convstem", "use_layernorm")
# name -> (timm model name or None, ConvNeXtImageNet keyword arguments); the three-conv ConvStem
# belongs to base/large, the two-conv one to tiny/small (Singh et al.).
CONVNEXTS: Dict[str, tuple] = {
    "convnext_tiny": ("convnext_tiny", dict(depths=(3, 3, 9, 3), dims=(96, 192, 384, 768))),
    "convnext_small": ("convnext_small", dict(depths=(3, 3, 27, 3), dims=(96, 192, 384, 768))),
    "convnext_base": ("convnext_base", dict(depths=(3, 3, 27, 3), dims=(128, 256, 512, 1024),
                                            convstem_three_convs=True)),
    "convnext_large": ("convnext_large", dict(depths=(3, 3, 27, 3), dims=(192, 384, 768, 1536),
                                              convstem_three_convs=True)),
    "convnext_test": (None, dict(depths=(1, 1, 1, 1), dims=(16, 32, 64, 128))),
}


def _register_resnet(name: str, arguments: Dict[str, Any]) -> None:
    @register(name)
    def build(num_classes: int, normalize_input: bool = True, use_batchnorm: bool = False,
              **options: Any):
        from rebm.models._timm_nets import ResNetImageNet

        return ResNetImageNet(num_classes=num_classes, normalize_input=normalize_input,
                              use_batchnorm=use_batchnorm, **arguments, **options)


def _register_convnext(name: str, arguments: Dict[str, Any]) -> None:
    @register(name, options=CONVNEXT_OPTIONS)
    def build(num_classes: int, normalize_input: bool = True, use_batchnorm: bool = False,
              use_convstem: bool = False, use_layernorm: bool = True, **options: Any):
        from rebm.models._timm_nets import ConvNeXtImageNet

        return ConvNeXtImageNet(num_classes=num_classes, normalize_input=normalize_input,
                                use_batchnorm=use_batchnorm, use_convstem=use_convstem,
                                use_layernorm=use_layernorm, **arguments, **options)


for _name, (_timm, _arguments) in RESNETS.items():
    _register_resnet(_name, _arguments)
for _name, (_timm, _arguments) in CONVNEXTS.items():
    _register_convnext(_name, _arguments)
