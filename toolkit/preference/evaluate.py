"""Held-out pairs: loss, rewards, reward accuracy and margin over the whole eval set (all ranks), and
exact match of greedy answers against the chosen completion."""

from __future__ import annotations

import torch

from toolkit.data import model_inputs
from toolkit.generation import greedy_answer
from toolkit.preference.config import DpoConfig
from toolkit.preference.data import strided_batches
from toolkit.preference.loss import pair_terms, sequence_logps, step_metrics


@torch.no_grad()
def evaluate_pairs(model, dataset, collate, accelerator, cfg: DpoConfig, reference, batch_size: int) -> dict:
    """Collective: eval_* metrics over every pair of `dataset`; `reference(batch)` gives the reference
    log-probs of a stacked batch (None for reference-free losses)."""
    model.eval()
    sums = torch.zeros(10, dtype=torch.float64, device=accelerator.device)
    for rows, real in strided_batches(
        dataset, accelerator.process_index, accelerator.num_processes, batch_size
    ):
        batch = {k: v.to(accelerator.device) for k, v in collate(rows).items()}
        logps, counts = sequence_logps(model(**model_inputs(batch)).logits, batch["labels"])
        terms = pair_terms(cfg, logps, counts, reference(batch))
        keep = torch.tensor(real, device=logps.device, dtype=torch.float64)
        chosen, rejected = logps.double().chunk(2)
        margin = (terms.chosen_rewards - terms.rejected_rewards).double()
        nll = -chosen if cfg.loss == "orpo" else torch.zeros_like(chosen)
        per_pair = [
            terms.losses.double(),
            nll,
            terms.chosen_rewards.double(),
            terms.rejected_rewards.double(),
        ]
        per_pair += [(margin > 0).double(), margin, chosen, rejected, torch.ones_like(chosen)]
        per_pair += [counts.chunk(2)[0].double()]
        sums += torch.stack([(value * keep).sum() for value in per_pair])
    model.train()
    totals = accelerator.reduce(sums, reduction="sum").tolist()
    return step_metrics(totals[:8], pairs=int(totals[8]), chosen_tokens=int(totals[9]), prefix="eval_")


def pair_exact_match(model, tokenizer, dataset, samples: int, max_new_tokens: int, synced: bool) -> float:
    """Share of the first `samples` eval pairs whose greedy answer equals the chosen completion."""
    rows = [dataset[i] for i in range(min(samples, len(dataset)))]
    hits = sum(
        greedy_answer(model, tokenizer, row["prompt_ids"], max_new_tokens, synced)
        == tokenizer.decode(row["chosen_ids"], skip_special_tokens=True).strip()
        for row in rows
    )
    return hits / max(len(rows), 1)
