"""Models know nothing about processes: they take tensors and return logits.

A model is one registration in the registry (`rebm.models.registry.register`). Importing this
package does not import torch (config validation imports it); everything else is loaded on first
use (PEP 562 module __getattr__).
"""

from rebm.models.registry import build_model, model_from_config, model_names, register

_LAZY = ("WideResNet", "dataset_stats", "CIFAR10_MEAN", "CIFAR10_STD")
__all__ = ["build_model", "model_from_config", "model_names", "register", *_LAZY]


def __getattr__(name: str):
    if name == "MODEL_NAMES":
        return model_names()
    if name in _LAZY:
        from rebm.models import wideresnet

        return getattr(wideresnet, name)
    raise AttributeError(f"module 'rebm.models' has no attribute '{name}'")
