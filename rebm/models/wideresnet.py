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

from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from rebm.models.registry import register

# CIFAR-10 training-set statistics, to full precision; the original uses them for CIFAR-100 too.
CIFAR10_MEAN = (0.4913997551666284, 0.48215855929893703, 0.4465309133731618)
CIFAR10_STD = (0.24703225141799082, 0.24348516474564, 0.26158783926049628)
# Digits are grey images replicated to 3 channels by the data pipeline.
DIGITS_MEAN = (0.5, 0.5, 0.5)
DIGITS_STD = (0.5, 0.5, 0.5)
# ImageNet training-set statistics (timm's IMAGENET_DEFAULT_MEAN / _STD, the `robustness`
# library's normaliser), used by the ImageNet models.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# name -> (depth, widen factor), each registered below
ARCHITECTURES = {
    "WideResNet34x10": (34, 10),
    "WideResNet28x10": (28, 10),
    "WideResNet16x4": (16, 4),
    "WideResNet16x2": (16, 2),
    "WideResNet10x1": (10, 1),
}


def dataset_stats(indist_dataset: str) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """(mean, std) used for input normalisation of a model trained on `indist_dataset`."""
    if indist_dataset == "digits":
        return DIGITS_MEAN, DIGITS_STD
    if indist_dataset.lower() == "imagenet":
        return IMAGENET_MEAN, IMAGENET_STD
    if indist_dataset.startswith("cifar") or indist_dataset == "imagefolder":
        return CIFAR10_MEAN, CIFAR10_STD
    raise ValueError(f"no normalisation statistics for data.indist_dataset '{indist_dataset}'")


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


class WideResNet(nn.Module):
    """WRN-depth-widen_factor; positional order and defaults of the original constructor.

    activation: "relu" (DAT's choice) or "swish"; dropRate: dropout before each block's second
    conv (train mode only; it draws from the global RNG, so unlike everything else in rebm it is
    not keyed per sample); return_feature_map: forward returns the pooled features (B,
    nChannels) instead of logits. None of the three adds state-dict entries.
    """

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
        self.use_batchnorm = use_batchnorm
        self.normalize_input = normalize_input
        self.return_feature_map = return_feature_map
        mean = CIFAR10_MEAN if mean is None else tuple(mean)
        std = CIFAR10_STD if std is None else tuple(std)
        # persistent=False: constants of the data, not weights; original checkpoints lack them.
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)

        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, stride=1, padding=1, bias=False)
        self.block1 = NetworkBlock(n, widths[0], widths[1], 1, activation, dropRate)
        self.block2 = NetworkBlock(n, widths[1], widths[2], 2, activation, dropRate)
        self.block3 = NetworkBlock(n, widths[2], widths[3], 2, activation, dropRate)
        self.bn1 = nn.BatchNorm2d(widths[3])
        self.fc = nn.Linear(widths[3], num_classes)
        self.num_features = self.nChannels = widths[3]  # nChannels: the original's name
        self._init_weights()
        self.train()  # applies the frozen-BatchNorm rule from the start

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

    def train(self, mode: bool = True) -> "WideResNet":
        """With use_batchnorm=False every BatchNorm stays in eval mode: its running stats act as a
        fixed affine map (gamma/beta still learn). Wrappers (DDP, DataParallel, compile, EMA
        copies) call this method recursively, so the rule holds through them."""
        super().train(mode)
        if mode and not self.use_batchnorm:
            for m in self.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):  # includes SyncBatchNorm
                    m.eval()
        return self

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if self.normalize_input:
            x = (x - self.mean) / self.std
        out = self.conv1(x)
        out = self.block3(self.block2(self.block1(out)))
        out = self.act(self.bn1(out))
        # Pool over the whole map: 8x8 at 32 px as in the original, 4x4 at 16 px.
        out = F.avg_pool2d(out, kernel_size=out.shape[-2:])
        return out.flatten(1)

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.return_feature_map:
            return self.features(x)
        logits = self.fc(self.features(x))
        if y is None:
            return logits
        return logits[torch.arange(logits.shape[0], device=logits.device), y]


def _register_wideresnet(name: str, depth: int, widen_factor: int) -> None:
    @register(name)
    def build(num_classes: int, use_batchnorm: bool = False, **options) -> WideResNet:
        return WideResNet(depth=depth, widen_factor=widen_factor, num_classes=num_classes,
                          use_batchnorm=use_batchnorm, **options)


for _name, (_depth, _widen) in ARCHITECTURES.items():
    _register_wideresnet(_name, _depth, _widen)
