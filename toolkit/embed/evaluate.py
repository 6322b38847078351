"""The held-out retrieval of an embedding run: each held-out anchor queried against every held-out
positive and hard negative (the corpus, each text once); NDCG@10, MRR@10, recall@1 and recall@k before
and after training, and the run's closing lines."""

from __future__ import annotations

import shlex

import torch

from toolkit.embed import mteb_tasks
from toolkit.embed.classify import class_logits, class_metrics
from toolkit.embed.data import Triplet
from toolkit.embed.metrics import rank_metrics, relevant_ranks, retrieval_metrics
from toolkit.embed.pooling import encode_texts
from toolkit.embed.rerank import pair_scores
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
        self._hold(accelerator, model, tokenizer, cfg, log)
        self.pooling = pooling
        self.queries, self.corpus, self.relevant = (
            retrieval_set(rows, cfg.embed.query_prefix) if rows else ([], [], [])
        )

    def _hold(self, accelerator, model, tokenizer, cfg, log) -> None:
        """What every held-out evaluator keeps: the run's accelerator, model, tokenizer, config and metrics
        log, and nothing shown yet."""
        self.accelerator, self.model, self.tokenizer = accelerator, model, tokenizer
        self.cfg, self.log, self.shown = cfg, log, {}

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
        command = f"ftkit embed --model {final_dir}"
        if self.queries:
            asked = self.queries[0][len(self.cfg.embed.query_prefix) :]  # the folder adds the prefix itself
            command += f" --query {shlex.quote(asked)}"
            command += "".join(f" --text {shlex.quote(text)}" for text in self.corpus[:2])
        else:
            command += " --text ..."
        return [result, *self._mteb(final_dir), f"saved: {final_dir.resolve()}", f"try: {command}"]

    def _mteb(self, final_dir) -> list[str]:
        """`embed.mteb_tasks` on the exported folder (by the main process): each main score logged, shown."""
        names = self.cfg.embed.mteb_tasks
        if not names or not self.accelerator.is_main_process:
            return []
        scores = mteb_tasks.run_tasks(names, final_dir)
        self.log.write(self.cfg.train.max_steps, **scores)
        return ["mteb: " + ", ".join(f"{name.removeprefix('mteb/')} {v:.4f}" for name, v in scores.items())]


class RerankEvaluator(RetrievalEvaluator):
    """The held-out candidate lists of a reranker: each query's candidates scored by the cross-encoder and
    ranked; the same metrics as retrieval, over each list."""

    def __init__(self, accelerator, model, tokenizer, lists, cfg, log):
        self._hold(accelerator, model, tokenizer, cfg, log)
        self.lists = [c for c in lists or [] if max(c.scores) >= RELEVANT]
        self.queries = [c.query for c in self.lists]

    @torch.no_grad()
    def _metrics(self) -> dict:
        ranks = []
        with eager_blocks(), eval_mode(self.model):
            for candidates in self.lists:
                scores = score_pairs(
                    self.model, self.tokenizer, candidates.query, candidates.passages, self.cfg
                )
                relevant = [i for i, s in enumerate(candidates.scores) if s >= RELEVANT]
                ranks += relevant_ranks(scores[None], [relevant])
        results = rank_metrics(ranks, self.cfg.embed.recall_k, prefix="eval_")
        return {**results, "eval_candidates": sum(len(c.passages) for c in self.lists) / len(self.lists)}

    def closing(self, shown: dict[str, dict], final_dir) -> list[str]:
        after, before = shown.get("after", {}), shown.get("before", {})
        if "eval_ndcg@10" not in after:
            result = "result: no held-out evaluation (data.eval)"
        else:
            start = f"{before['eval_ndcg@10']:.3f} -> " if before else "(resumed) "
            lists = f"{len(self.lists)} candidate lists ({after['eval_candidates']:.3g} candidates each)"
            result = (
                f"result: held-out reranking NDCG@10 {start}{after['eval_ndcg@10']:.3f} over {lists}, "
                f"recall@1 {after['eval_recall@1']:.1%}"
            )
        command = f"ftkit embed --model {final_dir}"
        if self.lists:
            command += f" --query {shlex.quote(self.lists[0].query)}"
            command += "".join(f" --text {shlex.quote(text)}" for text in self.lists[0].passages[:2])
        return [result, f"saved: {final_dir.resolve()}", f"try: {command}"]


RELEVANT = 0.5
"""A candidate whose target score is at least this counts as relevant."""


def score_pairs(model, tokenizer, query: str, passages: list[str], cfg) -> torch.Tensor:
    """The cross-encoder's score of `query` with each passage, `train.micro_batch_size` pairs at a time."""
    device, scores = next(model.parameters()).device, []
    step = cfg.train.micro_batch_size
    for start in range(0, len(passages), step):
        chunk = passages[start : start + step]
        batch = tokenizer(
            [query] * len(chunk),
            chunk,
            padding=True,
            truncation=True,
            max_length=cfg.data.max_length,
            return_tensors="pt",
        )
        scores.append(pair_scores(model, {k: batch[k].to(device) for k in ("input_ids", "attention_mask")}))
    return torch.cat(scores)


class ClassifierEvaluator(RetrievalEvaluator):
    """The held-out texts of a classifier: accuracy, macro F1 and each label's F1."""

    def __init__(self, accelerator, model, tokenizer, rows, cfg, log):
        self._hold(accelerator, model, tokenizer, cfg, log)
        self.rows = rows or []
        self.queries = [r.text for r in self.rows]

    @torch.no_grad()
    def _metrics(self) -> dict:
        device, predicted = next(self.model.parameters()).device, []
        step = self.cfg.train.micro_batch_size
        with eager_blocks(), eval_mode(self.model):
            for start in range(0, len(self.queries), step):
                batch = self.tokenizer(
                    self.queries[start : start + step],
                    padding=True,
                    truncation=True,
                    max_length=self.cfg.data.max_length,
                    return_tensors="pt",
                )
                inputs = {k: batch[k].to(device) for k in ("input_ids", "attention_mask")}
                predicted += class_logits(self.model, inputs).argmax(-1).tolist()
        return class_metrics(predicted, [r.label for r in self.rows], self.cfg.embed.labels, prefix="eval_")

    def closing(self, shown: dict[str, dict], final_dir) -> list[str]:
        after, before = shown.get("after", {}), shown.get("before", {})
        if "eval_accuracy" not in after:
            result = "result: no held-out evaluation (data.eval)"
        else:
            start = f"{before['eval_accuracy']:.1%} -> " if before else "(resumed) "
            result = (
                f"result: held-out accuracy {start}{after['eval_accuracy']:.1%} over {len(self.rows)} texts, "
                f"macro F1 {after['eval_macro_f1']:.3f}"
            )
        text = shlex.quote(self.queries[0] if self.queries else "...")
        return [
            result,
            f"saved: {final_dir.resolve()}",
            f"try: ftkit embed --model {final_dir} --text {text}",
        ]
