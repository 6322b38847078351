"""The vLLM engine of `grpo.generation: vllm` in `ftkit plan`: what it takes of a GPU, and where.

With the engine, completions are sampled by a separate vLLM process, so HF generate's phase
(`plan.generation`) does not happen on the training GPUs; the trainer still scores the round's completions
(its log-probs, the reference's), a forward without gradients in training's micro-batches, which
training's own peak covers. A LoRA round's sync sends the adapter only; a full fine-tune's gather of its
whole weights for the sync is not counted. The engine on a GPU of G GiB at U =
grpo.vllm.gpu_memory_utilization takes

    engine     U x G in all, whatever it serves: vLLM sizes its KV cache to fill that share
    weights    W = the model's parameters x e (the dtype training computes in: e = 2 under bf16), a LoRA
               adapter at lora.r included (the engine serves model.path whole, never 4-bit)
    kv cache   K = U x G - W, an upper bound: vLLM's profiling pass (activations) and its CUDA graphs come
               out of the same share
    rows       K // (C x e): completions of T = data.max_length + grpo.max_new_tokens tokens whose cache
               it holds at once, C the elements one such row caches (`plan.generation`'s formula, no tensor
               parallelism); at least one, or vLLM refuses to start (its max_model_len is T)

Two layouts. Shared (`--engine shared`, grpo.vllm.url and grpo.vllm.gpus unset): ftkit starts the engine
on the main process's GPU, so that GPU holds training's peak and the engine's U x G together. It sleeps
between rounds there (grpo.vllm.sleep), which frees its U x G while training runs, but training's weights,
optimizer states and cached blocks stay on the GPU while it generates: the plan does not split the two
phases and counts both together, an upper bound. Own (`--engine own`): the engine on GPUs of its own
(grpo.vllm.gpus, or yours at grpo.vllm.url; taken as large as a training GPU): the training GPUs hold
training only, the engine's GPU U x G. With grpo.vllm.replicas R (own GPUs only) each copy takes a GPU of
its own: R GPUs of U x G, R times the rows at once, the run on training's GPUs + R.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.launch.machine import GIB
from toolkit.model.families import cache_elements
from toolkit.plan import memory
from toolkit.plan.memory import Precision


@dataclass(frozen=True)
class EngineBytes:
    """The engine on its GPU."""

    share: int
    """U x G: what vLLM takes of the GPU in all."""
    weights: int
    row_cache: int
    """KV cache of one completion of T tokens."""
    shared: bool
    """It shares the main process's training GPU (ftkit started it) rather than a GPU of its own."""

    @property
    def kv_cache(self) -> int:
        return max(self.share - self.weights, 0)

    @property
    def rows(self) -> int:
        """Completions whose cache it holds at once (0: it does not start)."""
        return self.kv_cache // self.row_cache

    @property
    def starts(self) -> bool:
        return self.rows >= 1

    @property
    def on_training_gpu(self) -> int:
        """What it adds to the main process's training GPU."""
        return self.share if self.shared else 0


def estimate(counts, request, precision: Precision) -> EngineBytes | None:
    """The engine a plan request asks for (None: grpo.generation hf, or another objective)."""
    if request.objective != "grpo" or request.generation != "vllm":
        return None
    e = memory.compute_bytes(precision)
    row_cache = (cache_elements(counts.cache, request.row_tokens) + counts.state_per_sequence) * e
    share = int(request.gpu_memory_utilization * request.gpu_mem * GIB)
    return EngineBytes(share, counts.total * e, row_cache, request.engine == "shared")


def training_gpu_bytes(counts, request, precision: Precision) -> int:
    """What the engine adds to the main process's training GPU (0: none there)."""
    engine = estimate(counts, request, precision)
    return engine.on_training_gpu if engine else 0


def report_lines(engine: EngineBytes, request, training_peak: int | None, completions: int) -> list[str]:
    """The engine's memory in the plan's text, and what each layout puts on which GPU."""
    r = request
    share, weights, kv = (x / GIB for x in (engine.share, engine.weights, engine.kv_cache))
    lines = [
        f"engine   vLLM at gpu_memory_utilization {r.gpu_memory_utilization:g} of a {r.gpu_mem:g} GiB GPU: "
        f"{share:.1f} GiB = weights {weights:.1f} + KV cache {kv:.1f} (at most: vLLM's activations come "
        f"out of it), {engine.rows} rows of {r.row_tokens} tokens at once ({completions} a round)"
    ]
    if r.replicas > 1:
        lines.append(
            f"  {r.replicas} copies (grpo.vllm.replicas), a GPU each: {engine.rows * r.replicas} rows at "
            f"once in all, the round split between them; the run takes {r.gpus} training GPUs + {r.replicas}"
        )
    if not engine.starts:
        lines.append(
            f"  the engine does not start: its {share:.1f} GiB hold less than its weights and one row's "
            f"cache ({(engine.weights + engine.row_cache) / GIB:.1f} GiB); raise --gpu-memory-utilization"
        )
    peak = "" if training_peak is None else f"{training_peak / GIB:.1f} GiB "
    if engine.shared:
        lines.append(
            f"  shared (grpo.vllm.url and grpo.vllm.gpus unset: ftkit starts it on the main process's GPU, "
            f"asleep while training runs): that GPU holds training {peak}+ the engine's {share:.1f} GiB, "
            "counted together (an upper bound); the tables' totals include it (--engine own: a GPU of "
            "its own)"
        )
    else:
        lines.append(
            f"  own GPU (grpo.vllm.gpus, or yours at grpo.vllm.url): {_gpus(r.replicas)} of "
            f"{r.gpu_mem:g} GiB beside the {r.gpus} training GPUs holds the engine's {share:.1f} GiB; the "
            f"training GPUs hold training {peak}only"
        )
    return lines


def _gpus(replicas: int) -> str:
    return "a GPU" if replicas == 1 else f"each of {replicas} GPUs"
