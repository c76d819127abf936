"""ImageNet classifiers built from timm's ResNet and ConvNeXt classes, with the options of the
original DAT code: input normalisation inside the model, frozen BatchNorm, the ConvStem of Singh,
Croce & Hein (NeurIPS 2023), and `forward(x, y=None)`.

The networks *are* timm's classes (subclasses that add the options), so their state-dict names are
exactly timm's: timm's own weights, the `robustness` library's ResNets and the Singh et al. ConvNeXt
files load without renaming. The contract (normalisation buffers, frozen BatchNorm, forward(x, y))
is rebm.models.base's. This module imports timm, so it is private: the builders of timm_families.py
import it when such a model is built.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
from timm.layers import LayerNorm2d
from timm.models.convnext import ConvNeXt
from timm.models.resnet import Bottleneck, ResNet

from rebm.models.base import Classifier
from rebm.models.stats import IMAGENET_MEAN, IMAGENET_STD


class TimmClassifier(Classifier):
    """The contract (rebm.models.base) on a timm network: put it first among the bases, so its
    forward and train come before timm's; `mean`/`std` default to the ImageNet statistics."""

    default_stats = (IMAGENET_MEAN, IMAGENET_STD)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        # timm's own forward, on the normalised input
        return self.forward_head(self.forward_features(self.normalize(x)))


class ResNetImageNet(TimmClassifier, ResNet):
    """timm's ResNet (Bottleneck) with the ImageNet options."""

    def __init__(self, layers: Sequence[int], num_classes: int = 1000, base_width: int = 64,
                 normalize_input: bool = True, use_batchnorm: bool = False,
                 mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None,
                 in_channels: int = 3, **timm_options):
        ResNet.__init__(self, block=Bottleneck, layers=tuple(layers), num_classes=num_classes,
                        in_chans=in_channels, base_width=base_width, **timm_options)
        self.init_classifier(normalize_input=normalize_input, use_batchnorm=use_batchnorm,
                             mean=mean, std=std)


class ConvStem(nn.Module):
    """The convolutional stem of Singh et al.: 3x3 stride-2 convolutions, each followed by a
    channels-first LayerNorm and GELU, to `out_channels` at stride 4. `widths` are the conv
    output widths and strides the conv strides (two convs for tiny/small, three for base/large).
    The Sequential is named `stem`, so its weights are `stem.stem.<i>.*` as in their files."""

    def __init__(self, in_channels: int, widths: Sequence[int], strides: Sequence[int]):
        super().__init__()
        layers = []
        for width, stride in zip(widths, strides, strict=True):
            layers += [nn.Conv2d(in_channels, width, 3, stride=stride, padding=1),
                       LayerNorm2d(width, eps=1e-6), nn.GELU()]
            in_channels = width
        self.stem = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stem(x)


def convstem_for(dims0: int, three_convs: bool, in_channels: int = 3) -> ConvStem:
    """Singh et al.'s stems: two convs (w, 2w) for tiny/small, three (w, 1.5w, 2w; the last at
    stride 1) for base/large, with 2w = the first stage width."""
    w = dims0 // 2
    if three_convs:
        return ConvStem(in_channels, (w, w * 3 // 2, dims0), (2, 2, 1))
    return ConvStem(in_channels, (w, dims0), (2, 2))


class ConvNeXtImageNet(TimmClassifier, ConvNeXt):
    """timm's ConvNeXt with the ImageNet options; `use_convstem` replaces timm's patch stem by
    Singh et al.'s ConvStem. `use_layernorm` is the original's switch, which only kept LayerNorm
    layers in training mode: LayerNorm computes the same in both modes, so it changes nothing."""

    def __init__(self, depths: Sequence[int], dims: Sequence[int], num_classes: int = 1000,
                 normalize_input: bool = True, use_batchnorm: bool = False,
                 mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None,
                 in_channels: int = 3, use_convstem: bool = False,
                 convstem_three_convs: bool = False, use_layernorm: bool = True,
                 **timm_options):
        ConvNeXt.__init__(self, in_chans=in_channels, num_classes=num_classes,
                          depths=tuple(depths), dims=tuple(dims), **timm_options)
        self.use_convstem = use_convstem
        self.use_layernorm = use_layernorm
        if use_convstem:
            self.stem = convstem_for(dims[0], convstem_three_convs, in_channels)
        self.init_classifier(normalize_input=normalize_input, use_batchnorm=use_batchnorm,
                             mean=mean, std=std)
