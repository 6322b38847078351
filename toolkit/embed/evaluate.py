"""The held-out retrieval of an embedding run: each held-out anchor queried against every held-out
positive and hard negative (the corpus, each text once); NDCG@10, MRR@10, recall@1 and recall@k before
and after training, and the run's closing lines."""

from __future__ import annotations

import shlex

import torch

from toolkit.embed.data import Triplet
from toolkit.embed.metrics import retrieval_metrics
from toolkit.embed.pooling import encode_texts
from toolkit.model.speed import eager_blocks
from toolkit.train.evaluate import eval_mode


def retrieval_set(rows: list[Triplet], prefix: str) -> tuple[list[str], list[str], list[list[int]]]:
    """(queries, corpus, each query's relevant corpus rows) of held-out `rows`."""
    corpus = list(dict.fromkeys(text for t in rows for text in (t.positive, *t.negatives)))
    where = {text: i for i, text in enumerate(corpus)}
    return [prefix + t.anchor for t in rows], corpus, [[where[t.positive]] for t in rows]


class RetrievalEvaluator:
    """The held-out retrieval's evaluations: metrics at `evaluate`, and the printed before/after line at
    `report` (what the run's closing lines read, from `shown`). Every process embeds the whole held-out
    set, so sharded weights run their forward passes in step."""

    dataset = None  # text rows only: no image for the closing line to show

    def __init__(self, accelerator, model, tokenizer, rows, cfg, pooling: str, log):
        self.accelerator, self.model, self.tokenizer, self.cfg, self.pooling = (
            accelerator,
            model,
            tokenizer,
            cfg,
            pooling,
        )
        self.log, self.shown = log, {}
        self.queries, self.corpus, self.relevant = (
            retrieval_set(rows, cfg.embed.query_prefix) if rows else ([], [], [])
        )

    @torch.no_grad()
    def _metrics(self) -> dict:
        args = (self.tokenizer, self.pooling, self.cfg.data.max_length, self.cfg.train.micro_batch_size)
        with eager_blocks(), eval_mode(self.model):
            queries = encode_texts(self.model, self.queries, *args)
            corpus = encode_texts(self.model, self.corpus, *args)
        scores = queries @ corpus.T
        results = retrieval_metrics(scores, self.relevant, self.cfg.embed.recall_k, prefix="eval_")
        return {**results, "eval_corpus": len(self.corpus)}

    def evaluate(self, step: int) -> dict:
        """Collective: eval_* metrics logged at `step`; {} without held-out rows."""
        return self.log.write(step, **self._metrics()) if self.queries else {}

    def report(self, step: int, label: str) -> None:
        """Collective: the metrics, shown (tagged `label`) and logged."""
        if not self.queries:
            return
        results = self.shown[label] = self._metrics()
        self.accelerator.print(f"[{label}] " + "  ".join(f"{k}={v:.4g}" for k, v in results.items()))
        self.log.write(step, **results)

    def closing(self, shown: dict[str, dict], final_dir) -> list[str]:
        """The lines the run ends with: held-out recall@1 before -> after (and chance), where the model
        went, and how to try it."""
        after, before = shown.get("after", {}), shown.get("before", {})
        if "eval_recall@1" not in after:
            result = "result: no held-out evaluation (data.eval)"
        else:
            start = f"{before['eval_recall@1']:.1%} -> " if before else "(resumed) "
            chance = 1 / max(after["eval_corpus"], 1)
            result = (
                f"result: held-out recall@1 {start}{after['eval_recall@1']:.1%} over {after['eval_corpus']} "
                f"passages (chance {chance:.1%}), NDCG@10 {after['eval_ndcg@10']:.3f}"
            )
        text = shlex.quote(self.queries[0] if self.queries else "...")
        return [
            result,
            f"saved: {final_dir.resolve()}",
            f"try: ftkit embed --model {final_dir} --text {text}",
        ]
