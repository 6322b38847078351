"""Activation offload (`train.activation_offload`): the tensors a micro-batch's forward keeps for its backward
wait in CPU memory instead of the accelerator's, and come back when backward needs them.

The hooks are torch's saved-tensor hooks, entered around each micro-batch (`Run.micro_batch`). They move
only what costs memory: parameters (weights the backward reads anyway), tensor subclasses (DTensor, 4-bit
weights) and tensors under `MIN_BYTES` stay where they are. On a GPU the copies go into pinned memory on the
compute stream, so they are ordered with the kernels around them but not overlapped with them. The values
are copied bit for bit, so gradients are exactly those of a run without offload
(`tests/unit/test_offload.py`).
"""

from __future__ import annotations

import contextlib

import torch

MIN_BYTES = 2**16
"""Smaller saved tensors stay on the device: copying them costs more than the memory they free."""


class ActivationOffload:
    """Saved-tensor hooks that keep activations in CPU memory during a micro-batch's forward and backward.

    `device` is where the model computes; tensors already in CPU memory are left alone unless
    `copy_cpu_tensors` (the tests' stand-in for a device on a CPU-only machine). `moved_bytes` counts what
    the last micro-batches moved, for the tests and the start-up line."""

    def __init__(self, device: torch.device, copy_cpu_tensors: bool = False):
        self.pin = device.type == "cuda"
        self.copy_cpu_tensors = copy_cpu_tensors
        self.moved_bytes = 0

    def pack(self, tensor: torch.Tensor):
        size = tensor.numel() * tensor.element_size()
        stays = (
            isinstance(tensor, torch.nn.Parameter)
            or type(tensor) is not torch.Tensor
            or size < MIN_BYTES
            or (tensor.device.type == "cpu" and not self.copy_cpu_tensors)
        )
        if stays:
            return tensor
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=self.pin)
        host.copy_(tensor, non_blocking=self.pin)
        self.moved_bytes += size
        return tensor.device, host

    def unpack(self, packed):
        if isinstance(packed, tuple):
            device, host = packed
            return host.to(device, non_blocking=self.pin)
        return packed

    def hooks(self):
        """The context a micro-batch's forward runs in."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def activation_offload(enabled: bool, device: torch.device):
    """The context for one micro-batch: the offload hooks when `enabled`, else nothing."""
    return ActivationOffload(device).hooks() if enabled else contextlib.nullcontext()
