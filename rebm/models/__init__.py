"""Models know nothing about processes: they take tensors and return logits."""

# Placeholder registry; filled in by rebm/models/wideresnet.py
MODEL_NAMES = ("WideResNet34x10", "WideResNet28x10", "WideResNet16x2", "WideResNet16x4", "WideResNet10x1")
