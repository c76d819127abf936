"""Models know nothing about processes: they take tensors and return logits.

`MODEL_NAMES` is defined here without importing torch, because config validation imports it;
everything else is loaded on first use (PEP 562 module __getattr__).
"""

MODEL_NAMES = (
    "WideResNet34x10",
    "WideResNet28x10",
    "WideResNet16x4",
    "WideResNet16x2",
    "WideResNet10x1",
)

_LAZY = ("WideResNet", "build_model", "dataset_stats", "CIFAR10_MEAN", "CIFAR10_STD")
__all__ = ["MODEL_NAMES", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        from rebm.models import wideresnet

        return getattr(wideresnet, name)
    raise AttributeError(f"module 'rebm.models' has no attribute '{name}'")
