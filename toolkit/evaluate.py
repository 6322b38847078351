"""Held-out evaluation: token-exact loss and perplexity across ranks, greedy answers and exact match."""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader, Dataset

from toolkit.config import EvalConfig
from toolkit.data import model_inputs
from toolkit.loss import IGNORE, count_targets, summed_token_loss


class RankShard(Dataset):
    """Rank `rank`'s strided share of `dataset`, topped up with label-free copies of the first row so that
    every rank runs the same number of forward passes (sharded backends need them in lockstep) while
    the extra rows add nothing to the loss."""

    def __init__(self, dataset, rank: int, world_size: int):
        self.dataset = dataset
        self.indices = list(range(rank, len(dataset), world_size))
        self.length = math.ceil(len(dataset) / world_size)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        if i < len(self.indices):
            return self.dataset[self.indices[i]]
        row = self.dataset[0]
        return {"input_ids": row["input_ids"], "labels": [IGNORE] * len(row["labels"])}


def eval_loader(dataset, rank: int, world_size: int, batch_size: int, collate) -> DataLoader:
    return DataLoader(RankShard(dataset, rank, world_size), batch_size=batch_size, collate_fn=collate)


@torch.no_grad()
def evaluate(model, loader: DataLoader, accelerator, max_batches: int = 0) -> dict:
    """Collective: mean token loss over the whole eval set (all ranks) and its perplexity."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for i, batch in enumerate(loader):
        if max_batches and i >= max_batches:
            break
        batch = {key: value.to(accelerator.device) for key, value in batch.items()}
        logits = model(**model_inputs(batch)).logits
        labels = batch["labels"]
        totals += torch.stack(
            [
                summed_token_loss(logits, labels).double(),
                torch.tensor(float(count_targets(labels)), dtype=torch.float64, device=totals.device),
            ]
        )
    model.train()
    loss_sum, tokens = accelerator.reduce(totals, reduction="sum").tolist()
    loss = loss_sum / max(tokens, 1)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50)), "eval_tokens": int(tokens)}


def split_prompt(row: dict) -> tuple[list[int], list[int]] | None:
    """(prompt ids, reference answer ids) from a tokenized row: the first trained span is the answer."""
    labels = row["labels"]
    start = next((i for i, label in enumerate(labels) if label != IGNORE), None)
    if not start:
        return None
    end = next((i for i in range(start, len(labels)) if labels[i] == IGNORE), len(labels))
    return row["input_ids"][:start], row["input_ids"][start:end]


@torch.no_grad()
def greedy_answer(model, tokenizer, prompt_ids: list[int], max_new_tokens: int, synced: bool) -> str:
    """Collective when `synced`: every rank must call it with the same prompt (sharded weights)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        synced_gpus=synced,
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def exact_match(model, tokenizer, dataset, samples: int, max_new_tokens: int, synced: bool) -> float:
    """Share of the first `samples` answerable eval rows whose greedy answer equals the reference."""
    pairs = [p for p in (split_prompt(dataset[i]) for i in range(min(samples, len(dataset)))) if p]
    hits = sum(
        greedy_answer(model, tokenizer, prompt, max_new_tokens, synced)
        == tokenizer.decode(reference, skip_special_tokens=True).strip()
        for prompt, reference in pairs
    )
    return hits / max(len(pairs), 1)


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a one-turn user prompt ready for the assistant's answer."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def report(
    accelerator, model, tokenizer, eval_loader, eval_set, cfg: EvalConfig, log, step: int, label: str
) -> None:
    """Eval loss, exact match and one sample answer: shown before and after training, and logged."""
    results = {}
    if eval_loader is not None:
        results = evaluate(model, eval_loader, accelerator, cfg.max_batches)
    synced = accelerator.num_processes > 1
    generator = accelerator.unwrap_model(model)
    if eval_set is not None and cfg.exact_match_samples:
        results["exact_match"] = exact_match(
            generator, tokenizer, eval_set, cfg.exact_match_samples, cfg.max_new_tokens, synced
        )
    if results:
        log.write(step, **results)
        accelerator.print(f"[{label}] " + "  ".join(f"{k}={v:.4g}" for k, v in results.items()))
    prompt = cfg.sample_prompt
    pair = split_prompt(eval_set[0]) if not prompt and eval_set is not None else None
    prompt_ids = chat_prompt_ids(tokenizer, prompt) if prompt else pair[0] if pair else None
    if prompt_ids is not None:
        answer = greedy_answer(generator, tokenizer, prompt_ids, cfg.max_new_tokens, synced)
        question = " ".join(tokenizer.decode(prompt_ids, skip_special_tokens=True).split())
        accelerator.print(f"[{label}] sample: {question!r} -> {answer!r}")
