"""Build the embedded tiny encoder (toolkit/assets/tiny-bert): a BERT-style model on the tiny Llama's
tokenizer, pretrained by masked-language modelling on build_assets.py's corpus (sums and plain English),
saved as BertForMaskedLM so `embed.pooling: auto` pools it by the mean, as sentence-transformers does.

Run `python scripts/build_encoder_asset.py` (minutes on one core) after build_assets.py. The
tokenizer has no mask token: masked positions read <|endoftext|>, which the corpus uses only between
documents. Everything comes from fixed seeds.
"""

import random
import shutil
import time

import torch
from build_assets import ASSETS, SEED, arithmetic_document, english_document, split_pairs
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

SHAPE = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    intermediate_size=512,
    max_position_embeddings=512,
)
PRETRAIN = dict(steps=120, batch=16, seq_len=64, lr=2e-3, mask=0.15)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def masked(ids: torch.Tensor, mask_id: int, rate: float, generator: torch.Generator):
    """(inputs, labels): `rate` of the positions replaced by `mask_id`, the rest not scored."""
    chosen = torch.rand(ids.shape, generator=generator) < rate
    return ids.masked_fill(chosen, mask_id), ids.masked_fill(~chosen, -100)


def main():
    started = time.time()
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    seen, _ = split_pairs(rng)
    documents = [arithmetic_document(seen, rng) for _ in range(3000)] + [
        english_document(rng) for _ in range(2000)
    ]
    rng.shuffle(documents)
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")
    mask_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    stream = torch.tensor([t for d in documents for t in tokenizer(d)["input_ids"] + [mask_id]])
    config = BertConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **SHAPE)
    model = BertForMaskedLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PRETRAIN["lr"], weight_decay=0.01)
    generator = torch.Generator().manual_seed(SEED)
    steps, batch, seq_len = PRETRAIN["steps"], PRETRAIN["batch"], PRETRAIN["seq_len"]
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 10) * (1 - step / steps)
    )
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(stream) - seq_len, (batch,), generator=generator).tolist()
        inputs, labels = masked(
            torch.stack([stream[s : s + seq_len] for s in starts]), mask_id, PRETRAIN["mask"], generator
        )
        loss = model(input_ids=inputs, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 20 == 0 or step == steps - 1:
            print(f"pretrain step {step:4d}  masked-token loss {loss.item():.3f}", flush=True)
    folder = ASSETS / "tiny-bert"
    folder.mkdir(exist_ok=True)
    model.eval().save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copyfile(ASSETS / "tiny-llama" / name, folder / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"saved {params / 1e6:.2f}M parameters to {folder} in {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
