"""The embedding recipe's config: the shared recipe config plus an `embed` section."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from toolkit.config import RecipeConfig, load_config
from toolkit.embed import mteb_tasks
from toolkit.errors import UserError
from toolkit.fields import PositiveFloat, PositiveInt

DEMO_EMBED_CONFIG = Path(__file__).resolve().parents[1] / "assets" / "demo-embed.yaml"
Pooling = Literal["auto", "last", "mean", "cls"]


@dataclass
class EmbedConfig:
    task: Literal["embedding", "reranker", "classifier"] = "embedding"
    """What the model learns: embedding (texts to vectors, compared by cosine similarity), reranker (a
    cross-encoder: one score for a query and a passage read together) or classifier (a label per text)."""
    labels: list[str] = field(default_factory=list)
    """A classifier's labels, the only ones its data may hold (intent names, safe/unsafe, ...)."""
    rerank_loss: Literal["listwise", "pointwise"] = "listwise"
    """A reranker's loss: listwise (softmax cross-entropy of each row's positive against its hard
    negatives; triplet rows) or pointwise (binary cross-entropy against each (query, passage, score) row's
    score, from 0 to 1)."""
    pooling: Pooling = "auto"
    """Embeddings: how a text's token states become one vector: last (the last real token, for decoders),
    mean (over the real tokens), cls (the first token); auto: last for a decoder, mean for an encoder, or
    what a sentence-transformers folder says."""
    query_prefix: str = ""
    """Text put before every query (anchor), never before passages: an instruction such as
    "Instruct: Given a question, find the passage that answers it\\nQuery: " (Qwen3-Embedding's form)."""
    temperature: PositiveFloat = 0.05
    """Softmax temperature of the contrastive loss over cosine similarities."""
    matryoshka_dims: list[PositiveInt] = field(default_factory=list)
    """Leading dimensions also trained to embed on their own (each adds the loss on the truncated,
    renormalised vectors; equal weights); empty: the full vector only."""
    cached: bool = False
    """GradCache: embed the step's texts without gradients first, compute the loss over the whole global
    batch, then re-run each micro-batch with the loss's gradient: the same loss and gradients with far
    less memory, one more forward pass. A step of several micro-batches per process is always cached."""
    recall_k: PositiveInt = 5
    """The k of the held-out recall@k reported beside recall@1, MRR@10 and NDCG@10."""
    mteb_tasks: list[str] = field(default_factory=list)
    """MTEB tasks (e.g. STSBenchmark) run on the exported model after training, through the mteb package;
    each task's data set must already be in the local Hugging Face cache (nothing is downloaded)."""


@dataclass
class EmbedRecipeConfig(RecipeConfig):
    output_dir: str = "runs/demo-embed"
    """Where config.yaml, metrics.jsonl, checkpoints/ and final/ are written."""
    embed: EmbedConfig = field(default_factory=EmbedConfig)


def load_embed_config(path: str | Path | None, overrides: list[str]) -> EmbedRecipeConfig:
    """The recipe config at `path` (the demo when None), checked for what an embedding run needs."""
    cfg = load_config(path or DEMO_EMBED_CONFIG, overrides, schema=EmbedRecipeConfig)
    validate_embed(cfg)
    return cfg


def validate_embed(cfg: EmbedRecipeConfig) -> None:
    if cfg.train.global_batch_size < 2:
        raise UserError(
            f"train.global_batch_size: {cfg.train.global_batch_size} leaves a query no in-batch negative; "
            "the contrastive loss needs 2 or more"
        )
    if cfg.data.packing or cfg.data.streaming or cfg.data.group_by_length:
        raise UserError("data.packing, data.streaming and data.group_by_length do not apply to embeddings")
    if cfg.pipeline.size > 1:
        raise UserError("pipeline.size: embeddings do not train on a pipeline; use ddp, fsdp or zero3")
    if cfg.model.adapter:
        raise UserError("model.adapter: an embedding run starts from a base model, not an adapter")
    if cfg.embed.task == "classifier" and len(set(cfg.embed.labels)) != max(len(cfg.embed.labels), 2):
        raise UserError(f"embed.labels: a classifier needs 2 or more distinct labels, got {cfg.embed.labels}")
    if cfg.embed.mteb_tasks and cfg.embed.task != "embedding":
        raise UserError(f"embed.mteb_tasks: MTEB tasks evaluate an embedding model, not a {cfg.embed.task}")
    mteb_tasks.check_tasks(cfg.embed.mteb_tasks)
    if sorted(set(cfg.embed.matryoshka_dims), reverse=True) != cfg.embed.matryoshka_dims:
        raise UserError(
            f"embed.matryoshka_dims: {cfg.embed.matryoshka_dims}: give distinct sizes, largest first"
        )
