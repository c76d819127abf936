"""Models know nothing about processes: they take tensors and return logits.

A model is one registration in the registry (`rebm.models.registry.register`) of a family module
of this package; every family keeps the contract of `rebm.models.base.Classifier`. Importing this
package does not import torch (config validation imports it); the WideResNet class is loaded on
first use (PEP 562 module __getattr__).
"""

from rebm.models.registry import (
    build_model,
    family_options,
    model_from_config,
    model_names,
    register,
)
from rebm.models.stats import CIFAR10_MEAN, CIFAR10_STD, dataset_stats

__all__ = ["build_model", "family_options", "model_from_config",
           "model_names", "register", "dataset_stats", "CIFAR10_MEAN", "CIFAR10_STD", "WideResNet"]


def __getattr__(name: str):
    if name == "MODEL_NAMES":
        return model_names()
    if name == "WideResNet":
        from rebm.models.wideresnet import WideResNet

        return WideResNet
    raise AttributeError(f"module 'rebm.models' has no attribute '{name}'")
