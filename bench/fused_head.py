"""The chunked loss head's per-chunk math, eager passes against the compiled fused kernels
(`toolkit/train/fused_head.py`): time a call (forward and backward of the head alone) and peak memory, at
Llama-3's vocabulary. bench/gpu_check.py runs it as part of `startup`; on its own:

    python bench/fused_head.py [--tokens 8192] [--hidden 2048] [--vocab 128256] [--steps 10]

On a GPU the head is bf16 (peak memory from the CUDA allocator); on the CPU float32 and no memory figure.
Prints one JSON line per case."""

from __future__ import annotations

import argparse
import json
import time

import torch

from toolkit.train.fused_head import chunk_math
from toolkit.train.head import LogitShape, score


def measure(tokens: int, hidden: int, vocab: int, steps: int, fused: bool, chunk: int = 512) -> dict:
    """Seconds a head call takes (median of `steps`, after two warm-up calls that compile) and the peak
    memory above the inputs, for a frozen head (LoRA's case: only the hidden states' gradient)."""
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    gen = torch.Generator(device).manual_seed(0)
    weight = torch.randn(vocab, hidden, device=device, dtype=dtype, generator=gen) * hidden**-0.5
    states = torch.randn(1, tokens, hidden, device=device, dtype=dtype, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (1, tokens), device=device, generator=gen)
    shape = LogitShape(None, 1.0, None)
    math = chunk_math(shape.scale, shape.softcap) if fused else None
    times = []
    for i in range(steps + 2):
        states.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        started = time.perf_counter()
        score(states, weight, None, targets, chunk, True, shape, math).sum().backward()
        if cuda:
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - started)
    result = {"case": "fused" if fused else "eager", "tokens": tokens, "vocab": vocab, "dtype": str(dtype)}
    result["call_ms"] = round(1000 * sorted(times)[len(times) // 2], 2)
    if cuda:
        result["peak_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    for fused in (False, True):
        print(json.dumps(measure(args.tokens, args.hidden, args.vocab, args.steps, fused)), flush=True)


if __name__ == "__main__":
    main()
