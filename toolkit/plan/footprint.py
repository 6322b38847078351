"""What one GPU holds under one setup, as `ftkit plan` reports it: the model states, GRPO's generation phase,
and the whole row (`MemoryEstimate`). `plan.memory` and `plan.generation` fill them; the records sit below
both because a row holds a generation phase while the generation phase reads the memory formulas."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model state one rank holds at the end of a backward pass, its peak (`total`).

    To compare with a measurement: `after_step` is what is left once the optimizer has stepped and zeroed the
    gradients, and a walk of Python-visible tensors misses `grad_buckets`.
    """

    frozen: int
    """Frozen parameters (the base model under LoRA; 0 under full fine-tuning), this rank's shard."""
    trainable: int
    """Trainable parameters (the adapters under LoRA, all weights under full), this rank's shard."""
    persistent: int
    """ZeRO-3's whole copies of small parameters (<= 10 x hidden elements), kept beside their shards."""
    grads: int
    """Gradients as the optimizer reads them: param.grad, or DeepSpeed's flat gradient partitions."""
    grad_buckets: int
    """DDP's bucket copy of every gradient, held by its C++ reducer (a Python tensor walk does not see it)."""
    optimizer: int
    """AdamW exp_avg and exp_avg_sq."""
    master: int
    """DeepSpeed's fp32 master copy of its partition of the trainable parameters."""
    grads_persist: bool
    """The gradient buffers outlive the optimizer step (ZeRO-3); elsewhere zero_grad frees them."""
    in_cpu_ram: bool
    """All of it but `persistent` lives in CPU RAM (offload), not on the GPU."""

    @property
    def total(self) -> int:
        return (
            self.frozen
            + self.trainable
            + self.persistent
            + self.grads
            + self.grad_buckets
            + self.optimizer
            + self.master
        )

    @property
    def after_step(self) -> int:
        """What stays allocated after optimizer.step() and zero_grad() (gradients set to None)."""
        return self.total - (0 if self.grads_persist else self.grads)


@dataclass(frozen=True)
class GenerationBytes:
    """One GPU while a GRPO round generates; `total` is its peak."""

    rows: int
    """Completions the GPU generates at once."""
    tokens: int
    """Prompt budget plus new tokens of each."""
    resident: int
    """What stays from training: model states after a step on this GPU, a separate reference's weights."""
    gathered: int
    """Weights gathered for generation (sharded backends only)."""
    kv_cache: int
    logits: int
    prefill: int
    overhead: int
    """CUDA context, NCCL, DeepSpeed's buckets, fragmentation on this phase's tensors."""

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self) if f.name not in ("rows", "tokens"))


@dataclass(frozen=True)
class ImageBytes:
    """What one micro-batch's images hold on a GPU (a vision-language model's; `plan.images`)."""

    kept: int
    """Held from the forward until the backward: the pixel values and what trained tower blocks and a
    trained projector keep for their backward."""
    peak: int
    """The tower's own peak, which meets none of the language model's activations: `kept` and one block's
    activations over every patch."""


NO_IMAGES = ImageBytes(0, 0)
"""A text model's, or a micro-batch without images."""


@dataclass(frozen=True)
class MemoryEstimate:
    """One backend at one micro-batch size, with or without gradient checkpointing."""

    backend: str
    checkpointing: bool
    micro_batch: int
    states: ModelStateBytes
    working: int
    activations: int
    head: int
    """Of `activations`, the loss head's: the logits (full), or a chunk and what training keeps (chunked)."""
    overhead: int
    cpu_ram: int
    reference: int = 0
    """A separate frozen reference model's weights on this GPU (preference tuning; 0 otherwise)."""
    generation: GenerationBytes | None = None
    """GRPO's generation phase on this GPU (`plan.generation`); None for the other objectives."""
    images: int = 0
    """Of `activations`, what the images add (`ImageBytes`: their kept bytes, or the tower's peak where it
    is the larger); 0 for a text model."""
    engine: int = 0
    """grpo.generation vllm, the engine started by ftkit: its share of the main process's GPU (`plan.engine`),
    counted beside training's peak (an upper bound: it sleeps while training runs); 0 otherwise."""
    grads_meet_activations: bool = True
    """Whether the gradients and the activations peak together. Not with one micro-batch a step on a torch
    backend that frees its gradients at each step (single, DDP): backward frees activations as it makes
    gradients, so the peak holds the larger of the two, not both."""

    def per_gpu(self) -> dict[str, int]:
        """Bytes on each GPU by kind during training; `weights` includes gathered or autocast working copies.
        With a generation phase, `training` and `generation` are each phase's total and `total` the larger."""
        on_gpu = not self.states.in_cpu_ram
        # Under LoRA the trainable parameters are the adapters; under full fine-tuning (none frozen), weights.
        adapters = self.states.trainable if self.states.frozen else 0
        parts = {
            "weights": (self.states.frozen + self.states.trainable - adapters if on_gpu else 0)
            + self.working
            + self.states.persistent,
            "lora": adapters if on_gpu else 0,
            "grads": self.states.grads + self.states.grad_buckets if on_gpu else 0,
            "optimizer": self.states.optimizer + self.states.master if on_gpu else 0,
            "activations": self.activations,
            "overhead": self.overhead,
        }
        if self.reference:
            parts["reference"] = self.reference
        training = sum(parts.values())
        if not self.grads_meet_activations and on_gpu:
            training -= min(self.states.grads, self.activations)
        if self.engine:
            parts["engine"] = self.engine
            training += self.engine
        if self.generation is None:
            return {**parts, "total": training}
        generating = self.generation.total
        return {**parts, "training": training, "generation": generating, "total": max(training, generating)}

    @property
    def peak_phase(self) -> str:
        """training | generation: the phase `per_gpu()["total"]` comes from."""
        if self.generation is None:
            return "training"
        parts = self.per_gpu()
        return "generation" if parts["generation"] > parts["training"] else "training"
