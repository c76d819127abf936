"""Pre-activation WideResNet with the state-dict names of the original DAT / In-N-Out code.

The names (`conv1`, `blockS.layer.I.{bn1,conv1,bn2,conv2,convShortcut}`, `bn1`, `fc`) are part of
the contract (docs/design.md §1): checkpoints of the original code must load unchanged and give the
same logits. Input normalisation lives inside the model as non-persistent buffers, so it never
appears in (or is expected from) a state dict.

The constructor takes the original's arguments in the original's order and with its defaults
(`rebm/models/wide_resnet_innoutrobustness.py` of DAT): `WideResNet(depth, num_classes,
widen_factor=1, activation='relu', dropRate=0.0, return_feature_map=False, normalize_input=True,
use_batchnorm=True)`, so a ported `WideResNet(28, 10, 10)` is DAT's WRN-28-10 (live BatchNorm, as
there). rebm's additions are keyword-only: `in_channels`, `mean`, `std`. The registered builders
(`WideResNet34x10`, ...) call it by keyword and default to frozen BatchNorm (`use_batchnorm=False`,
the config's default); the training pipeline always passes `model.use_batchnorm` explicitly.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from rebm.models.base import Classifier
from rebm.models.registry import register
from rebm.models.stats import CIFAR10_MEAN, CIFAR10_STD

# name -> (depth, widen factor), each registered below
ARCHITECTURES = {
    "WideResNet34x10": (34, 10),
    "WideResNet28x10": (28, 10),
    "WideResNet16x4": (16, 4),
    "WideResNet16x2": (16, 2),
    "WideResNet10x1": (10, 1),
}


ACTIVATIONS = ("relu", "swish")


def _swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)  # the original's Swish, written the same way


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The original's `get_activation`, as a function (it has no parameters, so no state)."""
    if name == "relu":
        return F.relu
    if name == "swish":
        return _swish
    raise ValueError(f"WideResNet activation must be one of {', '.join(ACTIVATIONS)}, "
                     f"got {name!r}")


class BasicBlock(nn.Module):
    """BN -> act -> conv3x3 -> BN -> act (-> dropout) -> conv3x3, plus the shortcut.

    Where widths differ, the *pre-activated* input feeds the 1x1 `convShortcut` (as in the
    original); otherwise the raw input is added back. Dropout (dropRate > 0) sits where the
    original has it, before the second conv, and is active in train mode only.
    """

    def __init__(self, in_planes: int, out_planes: int, stride: int,
                 activation: str = "relu", drop_rate: float = 0.0):
        super().__init__()
        self.act = _activation(activation)
        self.drop_rate = drop_rate
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, out_planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_planes)
        self.conv2 = nn.Conv2d(out_planes, out_planes, 3, stride=1, padding=1, bias=False)
        self.convShortcut: Optional[nn.Conv2d] = None
        if in_planes != out_planes:
            self.convShortcut = nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.act(self.bn1(x))
        out = self.act(self.bn2(self.conv1(pre)))
        if self.drop_rate > 0:
            out = F.dropout(out, p=self.drop_rate, training=self.training)
        out = self.conv2(out)
        shortcut = x if self.convShortcut is None else self.convShortcut(pre)
        return shortcut + out


class NetworkBlock(nn.Module):
    """One stage; the `layer` attribute name is part of the state-dict contract."""

    def __init__(self, num_blocks: int, in_planes: int, out_planes: int, stride: int,
                 activation: str = "relu", drop_rate: float = 0.0):
        super().__init__()
        self.layer = nn.Sequential(
            *[
                BasicBlock(in_planes if i == 0 else out_planes, out_planes,
                           stride if i == 0 else 1, activation, drop_rate)
                for i in range(num_blocks)
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class WideResNet(Classifier):
    """WRN-depth-widen_factor; positional order and defaults of the original constructor.

    activation: "relu" (DAT's choice) or "swish"; dropRate: dropout before each block's second
    conv (train mode only; it draws from the global RNG, so unlike everything else in rebm it is
    not keyed per sample); return_feature_map: forward returns the pooled features (B,
    nChannels) instead of logits. None of the three adds state-dict entries.
    """

    default_stats = (CIFAR10_MEAN, CIFAR10_STD)

    def __init__(
        self,
        depth: int,
        num_classes: int,
        widen_factor: int = 1,
        activation: str = "relu",
        dropRate: float = 0.0,  # noqa: N803 (the original's keyword)
        return_feature_map: bool = False,
        normalize_input: bool = True,
        use_batchnorm: bool = True,
        *,
        in_channels: int = 3,
        mean: Optional[Sequence[float]] = None,
        std: Optional[Sequence[float]] = None,
    ):
        super().__init__()
        if (depth - 4) % 6:
            raise ValueError(f"WideResNet depth must be 6n+4, got {depth}")
        if not 0.0 <= dropRate < 1.0:
            raise ValueError(f"WideResNet dropRate must be in [0, 1), got {dropRate}")
        self.act = _activation(activation)
        n = (depth - 4) // 6
        widths = [16, 16 * widen_factor, 32 * widen_factor, 64 * widen_factor]
        self.return_feature_map = return_feature_map
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, stride=1, padding=1, bias=False)
        self.block1 = NetworkBlock(n, widths[0], widths[1], 1, activation, dropRate)
        self.block2 = NetworkBlock(n, widths[1], widths[2], 2, activation, dropRate)
        self.block3 = NetworkBlock(n, widths[2], widths[3], 2, activation, dropRate)
        self.bn1 = nn.BatchNorm2d(widths[3])
        self.fc = nn.Linear(widths[3], num_classes)
        self.num_features = self.nChannels = widths[3]  # nChannels: the original's name
        self._init_weights()
        self.init_classifier(normalize_input=normalize_input, use_batchnorm=use_batchnorm,
                             mean=mean, std=std)

    def _init_weights(self) -> None:
        # Same scheme as the original: He-normal (fan_out) convs, BN = identity, zero fc bias.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The pooled features (B, nChannels) of images in [0, 1]."""
        out = self.conv1(self.normalize(x))
        out = self.block3(self.block2(self.block1(out)))
        out = self.act(self.bn1(out))
        # Pool over the whole map: 8x8 at 32 px as in the original, 4x4 at 16 px.
        out = F.avg_pool2d(out, kernel_size=out.shape[-2:])
        return out.flatten(1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.return_feature_map:  # the original's option: features whatever y is
            return self.features(x)
        return super().forward(x, y)


def _register_wideresnet(name: str, depth: int, widen_factor: int) -> None:
    @register(name)
    def build(num_classes: int, use_batchnorm: bool = False, **options) -> WideResNet:
        return WideResNet(depth=depth, widen_factor=widen_factor, num_classes=num_classes,
                          use_batchnorm=use_batchnorm, **options)


for _name, (_depth, _widen) in ARCHITECTURES.items():
    _register_wideresnet(_name, _depth, _widen)
