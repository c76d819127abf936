"""Device memory of a training run, planned before it starts (`--check` prints it).

Per device, in bytes:
  parameters, gradients   one fp32 copy each;
  optimizer state         SGD: the momentum buffer (1 copy); Adam/AdamW: two moments (2 copies);
  EMA                     one more copy of the weights (use_ema);
  DDP buckets             DDP's flat gradient buckets, one more gradient copy (world size > 1);
  activations             what the largest pass keeps for its backward, for its images.

The activations are *measured*: one training-mode forward of a tiny batch at the configured image
size on the CPU, counting the bytes of every tensor autograd saves for the backward (each storage
once; parameters and buffers excluded), plus the backward's working set (the gradient of the
largest saved tensor and that tensor's twin, which coexist while it is consumed). This is scaled
linearly to the images of the largest pass. Activations are independent of the device, so the CPU
count holds on a GPU; what the plan does not see (CUDA context, cuDNN workspaces, allocator
fragmentation) is the `headroom` share kept free when finding the largest batch that fits.
With `amp: bf16` the saved activations are (mostly) bf16: the plan halves the fp32 count, an
estimate (the CPU's autocast op lists differ from CUDA's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.nn as nn

OPTIMIZER_COPIES = {"sgd": 1, "adam": 2, "adamw": 2}
GIB = 1024 ** 3


@dataclass
class MemoryPlan:
    parameters: int
    gradients: int
    optimizer_state: int
    ema: int
    ddp_buckets: int
    activation_bytes_per_image: int
    images_in_largest_pass: int
    micro_batch: int
    streams: int

    @property
    def fixed(self) -> int:
        """Bytes that do not depend on the batch size."""
        return self.parameters + self.gradients + self.optimizer_state + self.ema + self.ddp_buckets

    @property
    def activations(self) -> int:
        return self.activation_bytes_per_image * self.images_in_largest_pass

    @property
    def total(self) -> int:
        return self.fixed + self.activations

    def largest_micro_batch(self, device_bytes: float, headroom: float = 0.1) -> int:
        """The largest per_device_batch_size whose plan fits in (1 - headroom) of device_bytes
        (0: not even one image fits)."""
        free = device_bytes * (1.0 - headroom) - self.fixed
        per_micro_image = self.activation_bytes_per_image * self.streams
        return max(0, math.floor(free / per_micro_image)) if per_micro_image else 0

    def lines(self) -> List[str]:
        def gib(n: int) -> str:
            return f"{n / GIB:.2f} GiB" if n >= GIB / 2 else f"{n / 2**20:.1f} MiB"
        rows = [("parameters", self.parameters), ("gradients", self.gradients),
                ("optimizer state", self.optimizer_state), ("EMA", self.ema),
                ("DDP gradient buckets", self.ddp_buckets),
                (f"activations ({self.images_in_largest_pass} images in the largest pass, "
                 f"{self.activation_bytes_per_image / 2**20:.1f} MiB each)", self.activations)]
        out = [f"#   {name}: {gib(n)}" for name, n in rows]
        out.append(f"#   total: {gib(self.total)}")
        return out


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def saved_activation_bytes(model: nn.Module, x: torch.Tensor) -> Dict[str, int]:
    """One training-mode forward of `x` under autograd: the bytes of the tensors saved for the
    backward (each storage once, the model's own parameters and buffers excluded) and the
    largest of them."""
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    own |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen: Dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            ptr = t.untyped_storage().data_ptr()
            if ptr not in own and ptr:
                seen[ptr] = max(seen.get(ptr, 0), _tensor_bytes(t))
        return t

    x = x.clone().requires_grad_(True)  # the attacks need input gradients: x itself is kept
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    del out
    seen[x.untyped_storage().data_ptr()] = _tensor_bytes(x)
    return {"saved": sum(seen.values()), "largest": max(seen.values(), default=0)}


def activation_bytes_per_image(model: nn.Module, image_size: int, batch: int = 1,
                               in_channels: int = 3, amp: str = "none") -> int:
    """Measured activation bytes per image of one forward+backward at `image_size` (see the module
    docstring); the model is put in training mode for the count and restored."""
    was_training = model.training
    model.train()
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.rand(batch, in_channels, image_size, image_size, generator=gen)
        counts = saved_activation_bytes(model, x)
    finally:
        model.train(was_training)
    per_image = (counts["saved"] + 2 * counts["largest"]) / batch
    if amp in ("bf16", "fp16"):
        per_image /= 2
    return int(math.ceil(per_image))


def uninitialised_copy(build) -> nn.Module:
    """`build()` constructed on the meta device and given zeroed CPU storage: the shapes and
    bytes of the real model without the cost of its initialisers (seconds for 200M-parameter
    models); the values do not matter for counting bytes."""
    with torch.device("meta"):
        model = build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.zero_()
    return model


def plan_memory(model: nn.Module, image_size: int, micro_batch: int, streams: int,
                optimizer: str, use_ema: bool, world_size: int, amp: str = "none",
                eval_batch: Optional[int] = None, in_channels: int = 3) -> MemoryPlan:
    """The plan of one device: `streams` micro-batches of `micro_batch` images go through the
    largest training pass (DAT's fused loss forward); evaluation's batch counts if larger."""
    n_params = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    images = max(streams * micro_batch, eval_batch or 0)
    return MemoryPlan(
        parameters=n_params,
        gradients=trainable,
        optimizer_state=OPTIMIZER_COPIES.get(optimizer.lower(), 2) * trainable,
        ema=n_params if use_ema else 0,
        ddp_buckets=trainable if world_size > 1 else 0,
        activation_bytes_per_image=activation_bytes_per_image(model, image_size,
                                                              in_channels=in_channels, amp=amp),
        images_in_largest_pass=images,
        micro_batch=micro_batch,
        streams=streams,
    )
