"""Where a chat model answers: on the GPU with the most free memory when the model fits there beside what
already runs on it (a run training), else on the CPU with one line saying why. The need is the model's
weights as saved (its base's too, for an adapter) x HEADROOM + WORKSPACE; what is free is nvidia-smi's
figure, read when the model's worker starts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from toolkit.launch.machine import GIB

HEADROOM = 1.2
"""Weights as saved, times this: the KV cache and activations of a chat's short answers."""
WORKSPACE = 1 << 29
"""CUDA's context and allocator's reserve, bytes."""


def free_gpus(query=subprocess.run) -> list[tuple[int, int]]:
    """(index, free bytes) of each GPU nvidia-smi lists; [] without nvidia-smi or when it fails."""
    try:
        done = query(
            ["nvidia-smi", "--query-gpu=index,memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    found = []
    for line in done.stdout.splitlines():
        index, _, free = line.partition(",")
        if index.strip().isdigit() and free.strip().isdigit():
            found.append((int(index), int(free) << 20))
    return found


def weights_bytes(model_dir: Path) -> int:
    """Bytes of the model's weight files, and of its base's when it is an adapter with a local base."""
    size = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    adapter = model_dir / "adapter_config.json"
    if adapter.is_file():
        try:
            base = json.loads(adapter.read_text()).get("base_model_name_or_path") or ""
        except (OSError, ValueError):
            base = ""
        if base and Path(base).is_dir():
            size += sum(p.stat().st_size for p in Path(base).glob("*.safetensors"))
    return size


def place(model_dir: Path, gpus: list[tuple[int, int]]) -> tuple[str, str]:
    """(device, line): "cuda:I" and "" when GPU I has room, else "cpu" and why ("" with no GPU at all)."""
    if not gpus:
        return "cpu", ""
    need = int(weights_bytes(model_dir) * HEADROOM) + WORKSPACE
    index, free = max(gpus, key=lambda gpu: gpu[1])
    if free >= need:
        return f"cuda:{index}", ""
    return "cpu", (
        f"chat: {model_dir} needs about {need / GIB:.1f} GiB on a GPU and the most any GPU has free beside "
        f"what runs there is {free / GIB:.1f} GiB (GPU {index}): it answers on the CPU, slower"
    )
