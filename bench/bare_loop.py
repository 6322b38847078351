"""The floor: a bare Accelerate loop over plain padded batches with AdamW, nothing else.

BENCH_STATS=stats.json python bench/bare_loop.py MODEL_DIR DATA_JSONL
"""

import json
import sys

import torch
from accelerate import Accelerator
from common import BATCH, LEARNING_RATE, SEED, STEPS, StepStats, encode, pad_batch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(model_dir: str, data_path: str) -> None:
    stats = StepStats()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(data_path) as handle:
        rows = [encode(tokenizer, json.loads(line)["messages"]) for line in handle]
    # ftkit's sampler order (a torch permutation seeded with the run's seed): both train on the same batches.
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(SEED)).tolist()
    rows = [rows[i] for i in order]
    batches = [rows[i : i + BATCH] for i in range(0, STEPS * BATCH, BATCH)]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    for chunk in batches:
        stats.begin()
        batch = pad_batch(chunk, tokenizer.pad_token_id)
        loss = model(**batch, use_cache=False).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        stats.step(batch["attention_mask"].sum(), loss.item())
    stats.save()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
