"""The machine, probed once: GPUs (count, names, memory, bf16, peer-to-peer), CPU RAM, and the facts about
machines that the launch check, `ftkit train`, `ftkit doctor` and `ftkit plan` share. Importing it needs no
torch (the doctor still reports on a broken install); probing does."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
# GeForce RTX 40xx boards have no working GPU-to-GPU (P2P) path, whatever the driver reports.
GEFORCE_40 = re.compile(r"GeForce RTX 40\d\d", re.IGNORECASE)


@dataclass(frozen=True)
class Machine:
    """What launching and planning need to know about this machine (tests pass made-up ones)."""

    gpu_count: int = 0
    """GPUs visible to this process."""
    gpu_names: tuple[str, ...] = ()
    """CUDA device names."""
    gpu_mem_gib: float = 0.0
    """Memory of the smallest visible GPU, GiB."""
    bf16: bool = True
    """Every visible GPU computes in bf16."""
    p2p: bool = True
    """GPUs reach each other peer-to-peer."""
    ram_gib: float = 0.0
    """CPU RAM (or the container's limit), GiB."""


def probe_machine() -> Machine:
    """Query the visible GPUs (count, names, memory, bf16 support, peer-to-peer access) and the RAM."""
    import torch

    gpu_count, ram_gib = count_gpus(), ram_bytes() / GIB
    if not torch.cuda.is_available():
        return Machine(gpu_count=gpu_count, ram_gib=ram_gib)
    count = torch.cuda.device_count()
    return Machine(
        gpu_count=gpu_count,
        gpu_names=tuple(torch.cuda.get_device_name(i) for i in range(count)),
        gpu_mem_gib=min(torch.cuda.get_device_properties(i).total_memory for i in range(count)) / GIB,
        bf16=all(torch.cuda.get_device_capability(i) >= (8, 0) for i in range(count)),
        p2p=count < 2 or torch.cuda.can_device_access_peer(0, 1),
        ram_gib=ram_gib,
    )


def count_gpus() -> int:
    """Devices a GPU backend can use; Apple's MPS has no collective backend, so a Mac counts as CPU."""
    import torch

    if not hasattr(torch, "accelerator"):
        return torch.cuda.device_count()
    device = torch.accelerator.current_accelerator()
    return 0 if device is None or device.type == "mps" else torch.accelerator.device_count()


def ram_bytes() -> int:
    """Physical RAM, or the container's cgroup limit when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total
