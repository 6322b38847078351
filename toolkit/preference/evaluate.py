"""Held-out pairs: loss, rewards, reward accuracy and margin over the whole eval set (all ranks), and
exact match of greedy answers against the chosen completion."""

from __future__ import annotations

import torch

from toolkit.distributed import data_shard, unwrap
from toolkit.model.speed import eager_blocks
from toolkit.pipeline.generate import PipelineGenerator
from toolkit.preference.config import DpoConfig
from toolkit.preference.data import strided_batches
from toolkit.preference.loss import PairSums, batch_sequence_logps, pair_terms, target_counts
from toolkit.train.evaluate import eval_mode
from toolkit.train.generation import greedy_answer


@torch.no_grad()
def evaluate_pairs(
    model, dataset, collate, accelerator, cfg: DpoConfig, reference, batch_size: int, pipeline=None
) -> dict:
    """Collective: eval_* metrics over every pair of `dataset`; `reference(batch)` gives the reference
    log-probs of a stacked batch (None for reference-free losses); through `pipeline`'s stages if any.
    Compiled blocks run eagerly here (`eager_blocks`): an eval-mode graph would be one more compilation."""
    with eager_blocks():
        return _evaluate_pairs(model, dataset, collate, accelerator, cfg, reference, batch_size, pipeline)


def _evaluate_pairs(model, dataset, collate, accelerator, cfg, reference, batch_size, pipeline) -> dict:
    was_training = getattr(model, "module", model).training  # DeepSpeed's engine keeps a stale flag
    model.eval()
    sums = PairSums(accelerator.device)
    for rows, real in strided_batches(dataset, *data_shard(accelerator), batch_size):
        batch = {k: v.to(accelerator.device) for k, v in collate(rows).items()}
        if pipeline is not None:
            logps, counts = pipeline.forward_logps([batch])[0], target_counts(batch["labels"])
        else:
            logps, counts = batch_sequence_logps(model, batch)
        sums.add(pair_terms(cfg, logps, counts, reference(batch)), logps, counts, keep=real)
    model.train(was_training)
    return sums.reduce(accelerator).metrics(prefix="eval_")


class PairEvaluator:
    """The held-out pairs' evaluations, gathered once: metrics at `evaluate`, plus exact match and the
    printed before/after line at `report`."""

    def __init__(self, accelerator, model, tokenizer, dataset, collate, cfg, reference, log, pipeline=None):
        self.pipeline = pipeline
        self.shown: dict[str, dict] = {}
        """What each `report` measured, by its label ("before", "after"): the run's closing lines read it."""
        self.accelerator = accelerator
        self.model = model
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.collate = collate
        self.cfg = cfg
        self.reference = reference
        self.log = log

    def _metrics(self) -> dict:
        return evaluate_pairs(
            self.model,
            self.dataset,
            self.collate,
            self.accelerator,
            self.cfg.dpo,
            lambda batch: self.reference.logps(batch, "eval"),
            self.cfg.train.micro_batch_size,
            self.pipeline,
        )

    def evaluate(self, step: int) -> dict:
        """Collective: eval_* metrics logged at `step`; {} when the run has no eval pairs."""
        return self.log.write(step, **self._metrics()) if self.dataset is not None else {}

    def report(self, step: int, label: str) -> None:
        """Collective: the metrics and exact match of greedy answers, shown (tagged `label`) and logged."""
        if self.dataset is None:
            return
        with eval_mode(self.model):
            self._report(step, label)

    def _report(self, step: int, label: str) -> None:
        results = self._metrics()
        if self.cfg.eval.exact_match_samples:
            generator = unwrap(self.accelerator, self.model)
            if self.pipeline is not None:
                generator = PipelineGenerator(self.pipeline)
            results["exact_match"] = pair_exact_match(
                generator,
                self.tokenizer,
                self.dataset,
                self.cfg.eval.exact_match_samples,
                self.cfg.eval.max_new_tokens,
                self.accelerator.num_processes > 1,
                self.collate.images,
            )
        self.shown[label] = results
        self.accelerator.print(f"[{label}] " + "  ".join(f"{k}={v:.4g}" for k, v in results.items()))
        self.log.write(step, **results)


def pair_exact_match(
    model, tokenizer, dataset, samples: int, max_new_tokens: int, synced: bool, images=None
) -> float:
    """Share of the first `samples` eval pairs whose greedy answer equals the chosen completion; `images`
    (a vision-language model's data.ImageInputs) gives each prompt's image inputs."""
    rows = [dataset[i] for i in range(min(samples, len(dataset)))]
    hits = 0
    for row in rows:
        refs = row.get("images")
        pixels = (
            images.prompt_inputs(row["prompt_ids"], refs, "an eval pair")
            if images is not None and refs
            else None
        )
        answer = greedy_answer(model, tokenizer, row["prompt_ids"], max_new_tokens, synced, pixels)
        hits += answer == tokenizer.decode(row["chosen_ids"], skip_special_tokens=True).strip()
    return hits / max(len(rows), 1)
