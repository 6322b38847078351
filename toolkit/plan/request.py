"""What `ftkit plan` is asked: the machine, the method, the objective and the recipe settings it assumes, with
the recipes' defaults, checked as the recipe would check them. The estimate and every layout read it, so it
sits below them all."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Literal

from toolkit.config import LossConfig, LossHead, Method, VisionConfig
from toolkit.embed.config import EmbedConfig
from toolkit.errors import UserError
from toolkit.fields import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Probability,
    Range,
    field_errors,
)
from toolkit.grpo.config import Generation, GrpoConfig, VllmConfig
from toolkit.plan import GradCkpt, Objective, PlanDtype, PlanPrecision, generation
from toolkit.plan.memory import Head

EngineLayout = Literal["shared", "own"]


@dataclass(frozen=True)
class PlanRequest:
    model: str
    """Local model dir, config.json path, or hub id (built-in table or local cache)."""
    gpus: PositiveInt = 1
    """GPUs on the machine (one process each)."""
    gpu_mem: PositiveFloat = 24.0
    """Memory of one GPU in GiB (a "24 GB" RTX 4090 has 24 GiB)."""
    margin: Annotated[float, Range(low=0, high=0.5)] = 0.05
    """Share of each GPU's memory a setup must leave free to fit: the allocator's fragmentation and the
    kernels' workspaces vary from run to run (0: fill the card)."""
    method: Method = "lora"
    """How the model is fine-tuned, as the recipe's model.method."""
    seq_len: PositiveInt = 2048
    """Tokens per example (data.max_length); under grpo a prompt's, before its completion."""
    micro_batch: PositiveInt | None = None
    """Examples per forward pass per GPU; None: the largest that fits."""
    global_batch: PositiveInt = 32
    """Examples per optimizer step across all GPUs."""
    lora_r: PositiveInt = 16
    """LoRA rank (adapters on every linear layer)."""
    lora_dropout: Probability = 0.0
    """LoRA dropout; above 0 it stores a dropped copy of every adapted input."""
    grad_ckpt: GradCkpt = "auto"
    """Gradient checkpointing (auto: try off, then on)."""
    activation_offload: bool = False
    """train.activation_offload: the activations saved for backward wait in CPU RAM; the GPU holds one
    layer's."""
    packing: bool = False
    """data.packing (or data.streaming): whole examples packed into rows of --seq-len tokens, so a step's
    tokens are examples' rather than padding (sft only, as the recipes)."""
    longest_seq: bool = False
    """Also find each setup's and layout's longest --seq-len that fits (a multiple of 1024, up to 1M)."""
    dtype: PlanDtype = "auto"
    """Weights dtype (auto: bfloat16 for LoRA/QLoRA, float32 for full, as recipes)."""
    mixed_precision: PlanPrecision = "bf16"
    """Autocast."""
    cpu_mem: NonNegativeFloat | None = None
    """CPU RAM of the machine in GiB; when set, setups needing more do not fit."""
    objective: Objective = "sft"
    """What is trained: sft; dpo (preference tuning: two sequences, chosen and rejected, per example); grpo
    (online RL: a round generates completions, then training reads prompt + completion rows); embed (the
    embedding recipe: a model without its LM head, --embed-task saying which)."""
    reference_model: bool = False
    """dpo or grpo with a separate reference model: its frozen weights too (none with LoRA's adapter off or
    precomputed reference log-probs)."""
    loss_head: LossHead = LossConfig.head
    """How the loss reads the output head (loss.head; chunked: the logits never exist whole)."""
    chunk_tokens: PositiveInt = LossConfig.chunk_tokens
    """Label tokens per chunk of the chunked head (loss.chunk_tokens)."""
    generations: Annotated[int, Range(low=2)] = GrpoConfig.num_generations
    """grpo: completions sampled per prompt (grpo.num_generations)."""
    max_new_tokens: PositiveInt = GrpoConfig.max_new_tokens
    """grpo: tokens a completion may have, after its prompt (grpo.max_new_tokens)."""
    generation_batch: NonNegativeInt = GrpoConfig.generation_batch_size
    """grpo: completions a GPU generates at once (grpo.generation_batch_size; 0: its share of a round)."""
    steps_per_generation: PositiveInt = GrpoConfig.steps_per_generation
    """grpo: optimizer steps one round feeds (grpo.steps_per_generation)."""
    gather_for_generation: bool = GrpoConfig.gather_for_generation
    """grpo: under ZeRO-3/FSDP the whole model is gathered on each GPU to generate."""
    beta: NonNegativeFloat = GrpoConfig.beta
    """grpo: KL weight (grpo.beta); above 0 a reference is scored (LoRA's adapter off costs nothing)."""
    generation: Generation = GrpoConfig.generation
    """grpo: what samples the completions (grpo.generation): hf generate on the training GPUs, or vllm."""
    gpu_memory_utilization: Annotated[float, Range(low=0, high=1, low_open=True)] = (
        VllmConfig.gpu_memory_utilization
    )
    """grpo with vllm: share of its GPU the engine takes (grpo.vllm.gpu_memory_utilization)."""
    engine: EngineLayout = "shared"
    """grpo with vllm: shared (ftkit starts it on the main process's GPU) or own (yours at grpo.vllm.url, on
    a GPU of its own)."""
    replicas: PositiveInt = VllmConfig.replicas
    """grpo with vllm: copies of the engine (grpo.vllm.replicas), each on a GPU of its own (--engine own)."""
    embed_task: Literal["embedding", "reranker", "classifier"] = EmbedConfig.task
    """embed: embedding (the bare model pooled to a vector), reranker (a one-score head over a query and a
    passage read together) or classifier (a head of --labels scores) (embed.task)."""
    negatives: NonNegativeInt = 0
    """embed: hard negatives per row (the data's negative columns); an embedding row is an anchor, its
    positive and these, a listwise reranker row the pairs of its query with the positive and each."""
    cached: bool = EmbedConfig.cached
    """embed, embedding: GradCache (embed.cached); also whenever a process runs several micro-batches a
    step, as the recipe does."""
    labels: Annotated[int, Range(low=2)] = 2
    """embed, classifier: how many labels (len(embed.labels)): the head's width."""
    matryoshka_dims: tuple[int, ...] = ()
    """embed, embedding: Matryoshka sizes trained beside the full width (embed.matryoshka_dims): each adds
    its own normalised vectors and logits to the loss."""
    images_per_row: NonNegativeInt = 1
    """Vision-language models: images in each row (under dpo: in each pair's prompt, read by both rows)."""
    max_pixels: PositiveInt | None = VisionConfig.max_pixels
    """Vision-language models: pixels each image is scaled down to first (vision.max_pixels; None: as large
    as the row allows)."""
    train_projector: bool = VisionConfig.train_projector
    """Vision-language models: train the projector too (vision.train_projector)."""
    train_tower: bool = VisionConfig.train_tower
    """Vision-language models: train the vision tower too (vision.train_tower)."""
    tower_blocks: NonNegativeInt = VisionConfig.tower_blocks
    """Vision-language models, with train_tower: train only its last this many blocks (vision.tower_blocks;
    0: all)."""

    def validate(self) -> None:
        errors = field_errors(self)
        if errors:
            name, _, message = errors[0].partition(": ")
            raise UserError(f"--{_flag(name)} {message}")
        if self.reference_model and self.objective in ("sft", "embed"):
            raise UserError("--reference-model is for --objective dpo or grpo")
        if self.packing and self.objective != "sft":
            raise UserError(
                f"--packing is for --objective sft: the {self.objective} recipe batches whole rows"
            )
        if self.tower_blocks and not self.train_tower:
            raise UserError("--tower-blocks chooses the blocks --train-tower trains; add --train-tower")
        per_step = (self.micro_batch or 1) * self.gpus
        if self.global_batch % per_step:
            raise UserError(
                f"--global-batch {self.global_batch} is not a multiple of micro-batch x GPUs ({per_step})"
            )
        self._validate_embed()
        if self.objective == "grpo":
            self._validate_grpo()
            return
        changed = self._changed(GRPO_OPTIONS)
        if changed:
            raise UserError(f"--{_flag(changed[0])} is for --objective grpo")

    def _changed(self, names: tuple[str, ...]) -> list[str]:
        """Of the options `names`, those not at their defaults."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [name for name in names if getattr(self, name) != defaults[name]]

    def _validate_embed(self) -> None:
        """The embedding options belong to --objective embed, each to the task that reads it; what the
        embedding recipe would refuse (toolkit/embed/config.py), in the plan's words."""
        changed = self._changed(EMBED_OPTIONS)
        if changed and self.objective != "embed":
            raise UserError(f"--{_flag(changed[0])} is for --objective embed")
        for name, tasks in EMBED_TASK_OPTIONS.items():
            if name in changed and self.embed_task not in tasks:
                raise UserError(f"--{_flag(name)} is for --embed-task {' or '.join(tasks)}")
        if self.embedding and self.global_batch < 2:
            raise UserError(
                f"--global-batch {self.global_batch} leaves a query no in-batch negative; the contrastive "
                "loss needs 2 or more"
            )

    def _validate_grpo(self) -> None:
        """What the GRPO recipe would refuse (toolkit/grpo/config.py), in the plan's words."""
        completions = self.global_batch * self.steps_per_generation
        if completions % self.generations:
            raise UserError(
                f"--global-batch x --steps-per-generation ({completions}) must be a multiple of "
                f"--generations ({self.generations}): a round generates whole groups"
            )
        if self.reference_model and self.beta == 0:
            raise UserError("--reference-model with --objective grpo needs --beta > 0 (at 0 none is loaded)")
        if self.beta > 0 and self.method == "full" and not self.reference_model:
            raise UserError("--objective grpo --method full with --beta > 0 needs --reference-model")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        changed = [name for name in ENGINE_OPTIONS if getattr(self, name) != defaults[name]]
        if changed and self.generation != "vllm":
            raise UserError(f"--{_flag(changed[0])} is for --generation vllm")
        if self.replicas > 1 and self.engine == "shared":
            raise UserError(
                f"--replicas {self.replicas}: copies of the engine run on GPUs of their own; add --engine own"
            )

    @property
    def embedding(self) -> bool:
        """An embedding model (the bare transformer, pooled) is planned."""
        return self.objective == "embed" and self.embed_task == "embedding"

    @property
    def rows_per_example(self) -> int:
        """Sequences one example puts through the model: chosen and rejected under dpo; an anchor, its
        positive and its hard negatives for an embedding; a reranker's query paired with each candidate."""
        if self.objective == "embed":
            return {"embedding": 2, "reranker": 1, "classifier": 1}[self.embed_task] + self.negatives
        return 2 if self.objective == "dpo" else 1

    @property
    def row_tokens(self) -> int:
        """Tokens of one trained sequence: under grpo a prompt and its completion."""
        return self.seq_len + (self.max_new_tokens if self.objective == "grpo" else 0)

    @property
    def tokens_per_step(self) -> int:
        """Tokens a step computes: rows of --seq-len tokens (packed), or padded up to it at most."""
        return self.global_batch * self.rows_per_example * self.row_tokens

    @property
    def head(self) -> Head | None:
        """The loss head; dpo and grpo read per-token log-probs of the labels; None: no LM head (embed)."""
        if self.objective == "embed":
            return None
        return Head(self.loss_head, self.chunk_tokens, log_probs=self.objective != "sft")

    @property
    def head_width(self) -> int:
        """embed: scores a sequence's head gives (0: an embedding model, which has none)."""
        return {"embedding": 0, "reranker": 1, "classifier": self.labels}[self.embed_task]

    @property
    def vision(self) -> VisionConfig:
        """The recipe's vision section this plan assumes."""
        return VisionConfig(**{key: getattr(self, key) for key in VISION_KEYS})

    def check_model(self, model_type: str, seeing: bool) -> None:
        """What a text model (`seeing` false) or a vision-language one cannot be planned with."""
        if seeing:
            if self.objective == "grpo":
                raise UserError(
                    f"--objective grpo: the GRPO recipe does not train a vision-language model "
                    f"({model_type}) yet; sft and dpo do"
                )
            return
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        changed = [name for name in VISION_OPTIONS if getattr(self, name) != defaults[name]]
        if changed:
            key = f" (vision.{changed[0]})" if changed[0] in VISION_KEYS else ""
            raise UserError(
                f"--{_flag(changed[0])}{key} is for a vision-language model; {self.model} is a text model "
                f"({model_type})"
            )

    def generation_round(self) -> generation.Round | None:
        """GRPO's round of HF generate on the training GPUs (None for the other objectives and the engine)."""
        if self.objective != "grpo" or self.generation == "vllm":
            return None
        return generation.Round(
            completions=self.global_batch * self.steps_per_generation,
            batch=self.generation_batch,
            prompt_tokens=self.seq_len,
            new_tokens=self.max_new_tokens,
            gather=self.gather_for_generation,
        )


GRPO_OPTIONS = (
    "generations",
    "max_new_tokens",
    "generation_batch",
    "steps_per_generation",
    "gather_for_generation",
    "beta",
    "generation",
    "gpu_memory_utilization",
    "engine",
    "replicas",
)
"""The options only --objective grpo reads."""
EMBED_OPTIONS = ("embed_task", "negatives", "cached", "labels", "matryoshka_dims")
"""The options only --objective embed reads."""
EMBED_TASK_OPTIONS = {
    "negatives": ("embedding", "reranker"),
    "cached": ("embedding",),
    "labels": ("classifier",),
    "matryoshka_dims": ("embedding",),
}
"""Of those, the tasks each is read by."""
ENGINE_OPTIONS = ("gpu_memory_utilization", "engine", "replicas")
"""The options only --generation vllm reads."""
VISION_KEYS = ("train_projector", "train_tower", "tower_blocks", "max_pixels")
"""The options that are the recipe's vision keys, named alike."""
VISION_OPTIONS = ("images_per_row", *VISION_KEYS)
"""The options only a vision-language model reads."""


def _flag(name: str) -> str:
    return name.replace("_", "-")
