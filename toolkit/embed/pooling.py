"""A text's vector from its token states: the last real token (decoders, as Qwen3-Embedding), the mean over
real tokens (encoders, sentence-transformers' default) or the first token (cls); which one a model takes
when the config leaves it to `auto`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from toolkit.config import check_local_path
from toolkit.errors import UserError
from toolkit.model import vision

# sentence-transformers' names for the modes: its Pooling module's argument and its config's key.
ST_MODES = {"last": "lasttoken", "mean": "mean", "cls": "cls"}
ST_KEYS = {
    "last": "pooling_mode_lasttoken",
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
}
POOLING_CONFIG = "1_Pooling/config.json"


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """One vector per row of `hidden` (rows x tokens x width) from its real tokens (`mask`), in float32."""
    hidden, mask = hidden.float(), mask.to(hidden.device)
    if mode == "mean":
        weights = mask.unsqueeze(-1).float()
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
    if mode == "cls":
        return hidden[:, 0]
    # The last real token, wherever padding sits: the highest position the mask keeps.
    positions = torch.arange(mask.shape[1], device=mask.device) * mask
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), positions.argmax(1)]


def embed(model, batch: dict, mode: str, normalize: bool = True) -> torch.Tensor:
    """The vectors of a batch of tokenized texts (input_ids, attention_mask) from `model`'s last hidden
    states, in one forward pass; unit length with `normalize`."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    vectors = pool(out.last_hidden_state, batch["attention_mask"], mode)
    return F.normalize(vectors, dim=-1) if normalize else vectors


def model_pooling(model_cfg, mode: str) -> str:
    """The pooling of the model the config names (`mode`, or what `auto` finds for it)."""
    check_local_path(model_cfg.path, "model.path")
    return resolve_pooling(mode, model_cfg.path, vision.kind_of(model_cfg.path))


def resolve_pooling(mode: str, model_path: str, kind: str | None) -> str:
    """`mode` itself, or for `auto`: a sentence-transformers folder's own, else mean for an encoder (a model
    transformers builds for masked-LM pretraining) and last for a decoder (one it builds as a causal LM);
    a model that is neither is one line asking for embed.pooling."""
    if mode != "auto":
        return mode
    saved = Path(model_path).expanduser() / POOLING_CONFIG
    if saved.is_file():
        chosen = json.loads(saved.read_text())
        for ours, key in ST_KEYS.items():
            if chosen.get(key):
                return ours
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "mean"
    if kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "last"
    raise UserError(
        f"model.path: {model_path}: cannot tell how to pool its embeddings (model_type {kind!r} is neither "
        "a decoder nor an encoder transformers knows); set embed.pooling to last, mean or cls"
    )


def encode_texts(model, texts: list[str], tokenizer, mode: str, max_length: int, batch_size: int):
    """Unit vectors of `texts` (float32, on the model's device), `batch_size` at a time, tokenized as
    sentence-transformers tokenizes them (right-padded, cut to `max_length`)."""
    device = next(model.parameters()).device
    vectors = []
    for start in range(0, len(texts), batch_size):
        group = tokenizer(
            texts[start : start + batch_size],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        group = {k: group[k].to(device) for k in ("input_ids", "attention_mask")}
        vectors.append(embed(model, group, mode))
    return torch.cat(vectors) if vectors else torch.zeros(0)
