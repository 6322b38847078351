"""`ftkit embed`: an embedding model's vectors for texts, or its similarities of texts to a query; a
reranker's scores of texts against a query (`ftkit generate`'s sibling for recipes/embed_llm.py's exports)."""

from __future__ import annotations

import json

from toolkit import console
from toolkit.embed.saved import classify_texts, is_classifier, is_reranker, load_embedder, load_reranker
from toolkit.errors import UserError


def embed_cli(
    model_dir: str, texts: list[str], query: str | None, trust_remote_code: bool = False
) -> list[str]:
    """With a query: one line per text, its cosine similarity to the query (a reranker's score) then the
    text; without: one line per text, its unit vector as JSON (a classifier's label and probability)."""
    console.quiet_third_party()
    if is_classifier(model_dir):
        labelled = classify_texts(model_dir, texts, trust_remote_code)
        return [f"{label}\t{p:.4f}\t{text}" for (label, p), text in zip(labelled, texts, strict=True)]
    if is_reranker(model_dir):
        if query is None:
            raise UserError(f"--model: {model_dir} is a reranker: it scores texts against a --query")
        scores = load_reranker(model_dir, trust_remote_code).score(query, texts).tolist()
        return [f"{value:.4f}\t{text}" for value, text in zip(scores, texts, strict=True)]
    embedder = load_embedder(model_dir, trust_remote_code)
    vectors = embedder.encode(texts)
    if query is None:
        return [json.dumps([round(v, 6) for v in vector]) for vector in vectors.tolist()]
    similarities = (vectors @ embedder.encode([query], query=True)[0]).tolist()
    return [f"{value:.4f}\t{text}" for value, text in zip(similarities, texts, strict=True)]
