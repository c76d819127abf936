"""The shim that lets the original DAT code (github:xuwangyin/DAT at fb2ffc7) import and build its
models in the harness's original-side process. Installed before the original is imported;
nothing of it runs in rebm's process.

Why: the original's rebm/training/modeling.py imports, at module level,

    from timm.models.resnet import resnet50 as ResNet50ImageNet
    from timm.models.resnet import wide_resnet50_2 as WideResNet50x2ImageNet
    from timm.models.resnet import wide_resnet50_4 as WideResNet50x4ImageNet

from its own timm fork (the `pytorch-image-models` submodule, which its repository does not
contain: a checkout has an empty folder there). Upstream timm has no `wide_resnet50_4`, so the
import fails, and upstream `resnet50` / `wide_resnet50_2` do not take the fork's keywords
(`normalize_input`, `use_batchnorm`) nor its `forward(x, y)`. The shim bridges exactly these:

- `ResNetFork`: upstream timm's ResNet built as the fork's builders are called
  (`num_classes`, `normalize_input`, `use_batchnorm`), normalising the input with the ImageNet
  statistics inside the model, keeping BatchNorm in eval mode when `use_batchnorm` is false,
  and returning `logits[arange(B), y]` when labels are given (the contract the original's
  attacks and losses call);
- `resnet50`, `wide_resnet50_2`, `wide_resnet50_4` (base width 64 x 2, x 4) built on it, set on
  `timm.models.resnet` before the original imports them;
- `WideResNet16x4`, `WideResNet10x1`: the original's model file defines WideResNet-28/34/40/70
  factories but not 16-4 (the network of the CPU comparison) nor 10-1 (the run-level twin's);
  the shim adds them to that module, built by the original's own `WideResNet` class (depth 16,
  widen factor 4; depth 10, widen factor 1), nothing else changed.
"""

from __future__ import annotations

import torch
import torch.nn as nn

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _fork_resnet_class():
    from timm.models.resnet import Bottleneck, ResNet

    class ResNetFork(ResNet):
        def __init__(self, layers, base_width=64, num_classes=1000, normalize_input=True,
                     use_batchnorm=False, **options):
            super().__init__(block=Bottleneck, layers=layers, num_classes=num_classes,
                             base_width=base_width, **options)
            self.normalize_input, self.use_batchnorm = normalize_input, use_batchnorm
            self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1),
                                 persistent=False)
            self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1),
                                 persistent=False)
            self.train(self.training)

        def forward(self, x, y=None):
            if self.normalize_input:
                x = (x - self.mean) / self.std
            logits = super().forward(x)
            return logits if y is None else logits[torch.arange(logits.shape[0]), y]

        def train(self, mode=True):
            super().train(mode)
            if mode and not getattr(self, "use_batchnorm", True):
                for module in self.modules():
                    if isinstance(module, nn.modules.batchnorm._BatchNorm):
                        module.eval()
            return self

    return ResNetFork


def install() -> list:
    """Set the missing names; returns them (the side prints what it bridged)."""
    import timm.models.resnet as timm_resnet

    fork = _fork_resnet_class()
    builders = {
        "resnet50": lambda **kw: fork((3, 4, 6, 3), **kw),
        "wide_resnet50_2": lambda **kw: fork((3, 4, 6, 3), base_width=128, **kw),
        "wide_resnet50_4": lambda **kw: fork((3, 4, 6, 3), base_width=256, **kw),
    }
    for name, build in builders.items():
        setattr(timm_resnet, name, build)

    import rebm.models.wide_resnet_innoutrobustness as original_wrn  # the original's module

    def WideResNet16x4(num_classes=10, normalize_input=True, use_batchnorm=True, **options):
        return original_wrn.WideResNet(16, num_classes, 4, normalize_input=normalize_input,
                                       use_batchnorm=use_batchnorm, **options)

    def WideResNet10x1(num_classes=10, normalize_input=True, use_batchnorm=True, **options):
        return original_wrn.WideResNet(10, num_classes, 1, normalize_input=normalize_input,
                                       use_batchnorm=use_batchnorm, **options)

    original_wrn.WideResNet16x4 = WideResNet16x4
    original_wrn.WideResNet10x1 = WideResNet10x1
    return [f"timm.models.resnet.{name}" for name in builders] + [
        f"rebm.models.wide_resnet_innoutrobustness.{name}"
        for name in ("WideResNet16x4", "WideResNet10x1")]
