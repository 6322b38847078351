"""A short all-reduce on every GPU pair, each in its own process group under a timeout.

Consumer GPUs whose peer-to-peer path is broken make NCCL hang forever rather than fail, so each pair
runs as `python -m toolkit.commands.allreduce_check --devices I,J`: two processes that all-reduce a
tensor a few times and check the sum. A pair that hangs is killed with everything it started.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

NUMEL = 1 << 20
ROUNDS = 3
P2P_OFF = {"NCCL_P2P_DISABLE": "1"}


@dataclass(frozen=True)
class PairResult:
    devices: tuple[int, int]
    status: str
    """ok | hung | failed."""
    seconds: float
    """Wall time of the pair's processes, start-up included."""
    reason: str = ""
    """Why it hung or failed: the timeout, or the last line the processes wrote to stderr."""
    without_p2p: str | None = None
    """Status of the re-run with NCCL_P2P_DISABLE=1 (None: not re-run)."""


def check_pairs(
    gpu_count: int, timeout_s: float, backend: str = "nccl", env: Mapping[str, str] | None = None
) -> list[PairResult]:
    """Every pair of devices, one after another; a bad NCCL pair is retried once with P2P disabled."""
    env = dict(os.environ if env is None else env)
    results = []
    for pair in itertools.combinations(range(gpu_count), 2):
        result = run_pair(pair, timeout_s, backend, env)
        if result.status != "ok" and backend == "nccl" and "NCCL_P2P_DISABLE" not in env:
            retry = run_pair(pair, timeout_s, backend, {**env, **P2P_OFF})
            result = PairResult(pair, result.status, result.seconds, result.reason, retry.status)
        results.append(result)
    return results


def run_pair(pair: tuple[int, int], timeout_s: float, backend: str, env: Mapping[str, str]) -> PairResult:
    """One pair in a new session, so a timeout can kill the spawned workers along with their parent."""
    command = [sys.executable, "-m", __spec__.name, "--devices", f"{pair[0]},{pair[1]}", "--backend", backend]
    start = time.monotonic()
    with subprocess.Popen(
        command,
        cwd=Path(__file__).resolve().parents[2],
        env=dict(env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            _, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return PairResult(pair, "hung", time.monotonic() - start, f"no result within {timeout_s:g} s")
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        lines = [line.strip() for line in stderr.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit code {proc.returncode}"
        return PairResult(pair, "failed", seconds, reason)
    return PairResult(pair, "ok", seconds)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, devices: tuple[int, int], backend: str, port: int) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", devices[rank]) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for round_ in range(ROUNDS):
            x = torch.full((NUMEL,), float(rank + 1 + round_), device=device)
            dist.all_reduce(x)
            expected = float(2 * round_ + 3)
            if not torch.equal(x, torch.full_like(x, expected)):
                raise RuntimeError(f"all-reduce on {device} summed to {x[0].item()}, expected {expected}")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", required=True, help="two CUDA device indices, e.g. 0,1")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl", help="gloo: on CPU")
    args = parser.parse_args(argv)
    devices = tuple(int(d) for d in args.devices.split(","))
    if len(devices) != 2:
        parser.error("--devices takes exactly two indices")

    import torch
    import torch.multiprocessing as mp

    if args.backend == "nccl" and torch.cuda.device_count() <= max(devices):
        print(
            f"cuda:{max(devices)} is not visible: torch sees {torch.cuda.device_count()} GPUs",
            file=sys.stderr,
        )
        return 1
    mp.spawn(_worker, args=(devices, args.backend, _free_port()), nprocs=2)
    print(f"all-reduce of {NUMEL} floats x {ROUNDS} on devices {args.devices} ({args.backend}): ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
