"""An exported embedding model read back without sentence-transformers: the bare model and tokenizer of a
final/ folder, its pooling, maximum length and query prompt from the files sentence-transformers reads,
so `ftkit embed` and the tests embed exactly as the folder says."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.embed.pooling import POOLING_CONFIG, ST_KEYS, encode_texts
from toolkit.errors import UserError
from toolkit.model.saved import read_json


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


@dataclass
class SavedReranker:
    model: torch.nn.Module
    tokenizer: object
    max_length: int

    @torch.no_grad()
    def score(self, query: str, passages: list[str]) -> torch.Tensor:
        """The cross-encoder's raw score (its logit) of `query` with each passage."""
        batch = self.tokenizer(
            [query] * len(passages),
            passages,
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return logits.squeeze(-1).float()


def is_reranker(folder: str | Path) -> bool:
    """Whether `folder` holds a cross-encoder (sentence-transformers' config says so)."""
    return (
        read_json(Path(folder).expanduser() / "config_sentence_transformers.json").get("model_type")
        == "CrossEncoder"
    )


def is_classifier(folder: str | Path) -> bool:
    """Whether `folder` holds a sequence classifier of several labels (an embedding run's classifier)."""
    config = read_json(Path(folder).expanduser() / "config.json")
    named = any(str(name).endswith("ForSequenceClassification") for name in config.get("architectures") or [])
    return named and len(config.get("id2label") or {}) > 1


def classify_texts(
    folder: str | Path, texts: list[str], trust_remote_code: bool = False
) -> list[tuple[str, float]]:
    """(label, probability) of each text by the classifier exported in `folder`."""
    loaded = load_reranker(folder, trust_remote_code)
    batch = loaded.tokenizer(
        texts, padding=True, truncation=True, max_length=loaded.max_length, return_tensors="pt"
    )
    with torch.no_grad():
        probabilities = loaded.model(**batch).logits.float().softmax(-1)
    names = loaded.model.config.id2label
    return [(names[int(p.argmax())], float(p.max())) for p in probabilities]


def load_reranker(folder: str | Path, trust_remote_code: bool = False) -> SavedReranker:
    """The reranker (or classifier) exported in `folder`."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = Path(folder).expanduser()
    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "right"
    model = AutoModelForSequenceClassification.from_pretrained(
        str(folder), trust_remote_code=trust_remote_code
    )
    settings = read_json(folder / "sentence_bert_config.json")
    return SavedReranker(
        model.eval(), tokenizer, settings.get("max_seq_length") or tokenizer.model_max_length
    )


def load_embedder(folder: str | Path, trust_remote_code: bool = False) -> SavedEmbedder:
    """The embedding model exported in `folder`; a folder without sentence-transformers' pooling file is one
    line saying so."""
    from transformers import AutoModel, AutoTokenizer

    folder = Path(folder).expanduser()
    if not (folder / POOLING_CONFIG).is_file():
        raise UserError(f"--model: {folder} is not an embedding model folder (no {POOLING_CONFIG})")
    chosen = read_json(folder / POOLING_CONFIG)
    pooling = next((mode for mode, key in ST_KEYS.items() if chosen.get(key)), None)
    if pooling is None:
        raise UserError(f"{folder / POOLING_CONFIG}: none of {', '.join(ST_KEYS.values())} is set")
    settings = read_json(folder / "sentence_bert_config.json")
    prompts = read_json(folder / "config_sentence_transformers.json").get("prompts") or {}
    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "right"
    model = AutoModel.from_pretrained(str(folder), trust_remote_code=trust_remote_code).eval()
    max_length = settings.get("max_seq_length") or tokenizer.model_max_length
    return SavedEmbedder(model, tokenizer, pooling, max_length, prompts.get("query", ""))
