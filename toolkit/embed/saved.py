"""An exported embedding model read back without sentence-transformers: the bare model and tokenizer of a
final/ folder, its pooling, maximum length and query prompt from the files sentence-transformers reads,
so `ftkit embed` and the tests embed exactly as the folder says."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.embed.pooling import POOLING_CONFIG, ST_KEYS, encode_texts
from toolkit.errors import UserError


@dataclass
class SavedEmbedder:
    model: torch.nn.Module
    tokenizer: object
    pooling: str
    max_length: int
    query_prompt: str

    @torch.no_grad()
    def encode(self, texts: list[str], query: bool = False, batch_size: int = 32) -> torch.Tensor:
        """Unit vectors of `texts` (queries after the folder's query prompt)."""
        texts = [self.query_prompt + t for t in texts] if query else list(texts)
        return encode_texts(self.model, texts, self.tokenizer, self.pooling, self.max_length, batch_size)


def load_embedder(folder: str | Path, trust_remote_code: bool = False) -> SavedEmbedder:
    """The embedding model exported in `folder`; a folder without sentence-transformers' pooling file is one
    line saying so."""
    from transformers import AutoModel, AutoTokenizer

    folder = Path(folder).expanduser()
    if not (folder / POOLING_CONFIG).is_file():
        raise UserError(f"--model: {folder} is not an embedding model folder (no {POOLING_CONFIG})")
    chosen = _read(folder / POOLING_CONFIG)
    pooling = next((mode for mode, key in ST_KEYS.items() if chosen.get(key)), None)
    if pooling is None:
        raise UserError(f"{folder / POOLING_CONFIG}: none of {', '.join(ST_KEYS.values())} is set")
    settings = _read(folder / "sentence_bert_config.json")
    prompts = _read(folder / "config_sentence_transformers.json").get("prompts") or {}
    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "right"
    model = AutoModel.from_pretrained(str(folder), trust_remote_code=trust_remote_code).eval()
    max_length = settings.get("max_seq_length") or tokenizer.model_max_length
    return SavedEmbedder(model, tokenizer, pooling, max_length, prompts.get("query", ""))


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
