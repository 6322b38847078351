"""Run metrics: one JSON line per logged step in metrics.jsonl, mirrored to accelerate trackers."""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import time
from pathlib import Path

import torch

from toolkit.errors import UserError
from toolkit.model import flops


class MetricsLog:
    """Appends metric lines on the main process; other ranks hold an inert instance."""

    def __init__(self, path: Path, enabled: bool, tracker_log=None):
        self.path = path
        self.enabled = enabled
        self._tracker_log = tracker_log

    def write(self, step: int, **values) -> dict:
        record = {"step": step, **{k: _plain(v) for k, v in values.items()}, "time": round(time.time(), 3)}
        if self.enabled:
            _append_line(self.path, json.dumps(record) + "\n")
            if self._tracker_log is not None:
                self._tracker_log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)
        return record


class StepSpeed:
    """The speed numbers of one optimizer step: real-token throughput (all ranks and per device), step time,
    share of it spent waiting for data, MFU where the device's peak is known (CUDA), peak memory."""

    def __init__(self, shape: flops.ModelShape, device: torch.device, world_size: int):
        self.shape = shape
        self.device = device
        self.world_size = world_size
        self.device_name = flops.device_name(device)

    def measure(self, tokens: int, rows: int, elapsed: float, data_wait: float) -> dict:
        """`tokens` (non-padding) and `rows` (sequences) of the step summed over ranks, times in seconds."""
        tokens_per_s = tokens / elapsed
        values = {
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.world_size,
            "step_time_s": elapsed,
            "data_wait_frac": data_wait / elapsed,
            "peak_mem_mb": peak_memory_mb(self.device),
        }
        if self.device.type == "cuda":  # what `ftkit plan` predicts: the allocator's reserve and beyond it
            values.update(cuda_memory_mb(self.device))
        # Attention cost grows with the sequence: the step's mean real length stands in for it.
        per_token = self.shape.flops_per_token(round(tokens / max(rows, 1)))
        utilisation = flops.mfu(tokens_per_s, per_token, self.device_name, self.world_size)
        if utilisation is not None:
            values["mfu"] = utilisation
        return values


def _append_line(path: Path, line: str) -> None:
    """Append a whole line or nothing: a failed write (disk full, permissions) is cut back off."""
    size = path.stat().st_size if path.exists() else 0
    try:
        with path.open("a") as handle:
            handle.write(line)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.truncate(path, size)
        raise UserError(f"{path}: metrics line not written: {exc.strerror or exc}") from None


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory so far: allocated device memory on CUDA, the process's peak RSS elsewhere."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def cuda_memory_mb(device: torch.device) -> dict:
    """The caching allocator's peak reserve, and what the device holds outside the allocator (the CUDA
    context, other libraries' buffers) now."""
    free, total = torch.cuda.mem_get_info(device)
    outside = total - free - torch.cuda.memory_reserved(device)
    return {
        "peak_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20,
        "outside_allocator_mb": outside / 2**20,
    }


def read_metrics(path: Path, on_torn_tail=None) -> list[dict]:
    """Every record of a metrics.jsonl file (an empty list when it does not exist).

    With `on_torn_tail`, a last line cut short (the writer stopped mid-line) is dropped and reported to it;
    any other bad line is an error naming it."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines) and on_torn_tail is not None:
                on_torn_tail(f"warning: {path}:{number}: dropped a torn last line ({exc.msg})")
                break
            raise UserError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
    return records


def truncate_after(path: Path, step: int, say=print) -> None:
    """Drop lines logged after `step`, so a resumed run continues the file without duplicates."""
    kept = [r for r in read_metrics(path, on_torn_tail=say) if r["step"] <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def progress_fields(loss: float, lr: float, speed: dict) -> dict[str, str]:
    """The progress bar's short summary of a step."""
    fields = {
        "loss": f"{loss:.4f}",
        "lr": f"{lr:.2e}",
        "tok/s": f"{speed['tokens_per_s']:.0f}",
        "tok/s/dev": f"{speed['tokens_per_s_per_device']:.0f}",
    }
    if "mfu" in speed:
        fields["mfu"] = f"{speed['mfu']:.1%}"
    return fields


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return value
