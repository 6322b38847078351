"""Retrieval metrics of a query-by-document score matrix: NDCG@10, MRR@10 and recall@k, each query's
relevant documents ranked against the rest (a tie counts against the relevant document)."""

from __future__ import annotations

import math

import torch


def relevant_ranks(scores: torch.Tensor, relevant: list[list[int]]) -> list[list[int]]:
    """For each query (a row of `scores`), the 1-based rank of each of its relevant documents: one plus
    the irrelevant documents scored at least as high and the relevant ones scored higher."""
    ranks = []
    for row, docs in zip(scores, relevant, strict=True):
        mask = torch.ones_like(row, dtype=torch.bool)
        mask[docs] = False
        others, mine = row[mask], row[docs]
        ranks.append([1 + int((others >= s).sum()) + int((mine > s).sum()) for s in mine.tolist()])
    return ranks


def retrieval_metrics(scores: torch.Tensor, relevant: list[list[int]], k: int, prefix: str = "") -> dict:
    """ndcg@10, mrr@10, recall@1 and recall@k (the share of relevant documents in the top k), averaged
    over queries."""
    return rank_metrics(relevant_ranks(scores, relevant), k, prefix)


def rank_metrics(ranks_per_query: list[list[int]], k: int, prefix: str = "") -> dict:
    """`retrieval_metrics` from each query's relevant documents' ranks."""
    per_query = {"ndcg@10": [], "mrr@10": [], "recall@1": [], f"recall@{k}": []}
    for ranks in ranks_per_query:
        ideal = sum(1 / math.log2(i + 2) for i in range(min(len(ranks), 10)))
        per_query["ndcg@10"].append(sum(1 / math.log2(r + 1) for r in ranks if r <= 10) / ideal)
        per_query["mrr@10"].append(max((1 / r for r in ranks if r <= 10), default=0.0))
        for cut in (1, k):
            per_query[f"recall@{cut}"].append(sum(r <= cut for r in ranks) / len(ranks))
    return {f"{prefix}{name}": sum(v) / max(len(v), 1) for name, v in per_query.items()}
