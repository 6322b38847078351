"""`ftkit embed`: an embedding model's vectors for texts, or its similarities of texts to a query
(`ftkit generate`'s sibling for recipes/embed_llm.py's exports)."""

from __future__ import annotations

import json

from toolkit import console
from toolkit.embed.saved import load_embedder


def embed_cli(
    model_dir: str, texts: list[str], query: str | None, trust_remote_code: bool = False
) -> list[str]:
    """With a query: one line per text, its cosine similarity to the query then the text; without: one line
    per text, its unit vector as JSON."""
    console.quiet_third_party()
    embedder = load_embedder(model_dir, trust_remote_code)
    vectors = embedder.encode(texts)
    if query is None:
        return [json.dumps([round(v, 6) for v in vector]) for vector in vectors.tolist()]
    similarities = (vectors @ embedder.encode([query], query=True)[0]).tolist()
    return [f"{value:.4f}\t{text}" for value, text in zip(similarities, texts, strict=True)]
