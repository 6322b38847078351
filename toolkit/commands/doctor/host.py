"""`ftkit doctor`'s host checks: CPU cores and RAM per GPU, and free disk where runs go."""

from __future__ import annotations

from toolkit.commands.doctor.records import Finding, Probes
from toolkit.launch.machine import GIB

MIN_CORES_PER_GPU, GOOD_CORES_PER_GPU = 2, 4
MIN_RAM_PER_GPU = 16 * GIB
MIN_DISK, GOOD_DISK = 5 * GIB, 50 * GIB


def cpu(p: Probes) -> Finding:
    per_gpu = p.cpu_cores / max(1, len(p.gpus))
    message = f"{p.cpu_cores} CPU cores" + (f", {per_gpu:g} per GPU" if p.gpus else "")
    if per_gpu < MIN_CORES_PER_GPU:
        return Finding(
            "cpu",
            "warn",
            f"{message} (rule of thumb: {MIN_CORES_PER_GPU}-{GOOD_CORES_PER_GPU} per GPU)",
            "each process needs a core plus its data.num_workers: set data.num_workers: 0, "
            "or use fewer processes",
        )
    return Finding("cpu", "ok", message)


def ram(p: Probes) -> Finding:
    per_gpu = p.ram_bytes / max(1, len(p.gpus))
    message = f"{p.ram_bytes / GIB:.1f} GiB RAM" + (f", {per_gpu / GIB:.1f} GiB per GPU" if p.gpus else "")
    if per_gpu < MIN_RAM_PER_GPU:
        return Finding(
            "ram",
            "warn",
            f"{message} (rule of thumb: >= {MIN_RAM_PER_GPU // GIB} GiB per GPU)",
            "every process loads the whole model into RAM first (ZeRO-3 excepted): use "
            "zero3.yaml, a smaller model, or a machine with more RAM (ftkit plan shows the need)",
        )
    return Finding("ram", "ok", message)


def disk(p: Probes) -> Finding:
    message = f"{p.disk_free_bytes / GIB:.1f} GiB free at {p.output_dir}"
    fix = (
        "full fine-tune checkpoints hold weights and optimizer states: free space or pick another output_dir"
    )
    if p.disk_free_bytes < MIN_DISK:
        return Finding("disk", "fail", message, fix)
    if p.disk_free_bytes < GOOD_DISK:
        return Finding("disk", "warn", f"{message} (LoRA runs fit; full fine-tune checkpoints may not)", fix)
    return Finding("disk", "ok", message)
