"""What every contender shares: the model files, the data file, the padding collator and the stats file."""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = ROOT / "toolkit" / "assets" / "tiny-llama"
SEQ_LEN = 256
BATCH = 8
STEPS = 8
LEARNING_RATE = 5e-4
SEED = 0
EXAMPLES = 400


def build_model_dir(out: Path, moe: bool = False) -> None:
    """A random-init Llama (~20M parameters: large enough that compute shows) or, `moe`, a Qwen3-MoE of the
    same width (8 routed experts a layer, 2 per token), saved with the tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    experts = dict(moe_intermediate_size=704, num_experts=8, num_experts_per_tok=2, head_dim=64)
    config = (
        AutoConfig.for_model("qwen3_moe", **shape, **experts)
        if moe
        else AutoConfig.for_model("llama", **shape)
    )
    torch.manual_seed(SEED)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


def write_data(path: Path) -> None:
    """Alpaca-like chats of plain words with lognormal lengths (many short, a long tail past SEQ_LEN)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    text = sentences(tokenizer)

    with path.open("w") as handle:
        for _ in range(EXAMPLES):
            messages = [
                {"role": "user", "content": text(12, 0.8)},
                {"role": "assistant", "content": text(30, 0.9)},
            ]
            handle.write(json.dumps({"messages": messages}) + "\n")


def write_pairs(path: Path) -> None:
    """Preference pairs in the messages layout: a user turn and two assistant answers of plain words with
    lognormal lengths (as `write_data`), redrawn when the longer side would pass SEQ_LEN, so no tool's
    truncation rule comes into play."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    text = sentences(tokenizer)

    def length(prompt: list[dict], answer: str) -> int:
        turns = [*prompt, {"role": "assistant", "content": answer}]
        return len(tokenizer.apply_chat_template(turns, tokenize=True, return_dict=False))

    with path.open("w") as handle:
        written = 0
        while written < EXAMPLES:
            prompt = [{"role": "user", "content": text(12, 0.8)}]
            chosen, rejected = text(30, 0.9), text(30, 0.9)
            if max(length(prompt, chosen), length(prompt, rejected)) > SEQ_LEN:
                continue
            pair = {"prompt": prompt, "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}]}  # fmt: skip
            handle.write(json.dumps(pair) + "\n")
            written += 1


def sentences(tokenizer):
    """text(median_words, sigma): a sentence of the tokenizer's whole words (alphabetic, longer than two
    letters) with a lognormal word count, from a generator seeded with SEED."""
    words = sorted(
        {
            t.lstrip("Ġ▁")
            for t in tokenizer.get_vocab()
            if t.lstrip("Ġ▁").isalpha() and len(t.lstrip("Ġ▁")) > 2
        }
    )
    rng = random.Random(SEED)

    def text(median_words: float, sigma: float) -> str:
        n = max(1, int(rng.lognormvariate(math.log(median_words), sigma)))
        return " ".join(rng.choice(words) for _ in range(n)) + "."

    return text


def encode(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    return list(ids)[:SEQ_LEN]


def pad_batch(rows: list[list[int]], pad_id: int, multiple: int = 8) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row (rounded up to 8, as ftkit does); loss on every real token."""
    width = -(-max(len(r) for r in rows) // multiple) * multiple
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class StepStats:
    """Wall-clock time at the start of the first optimizer step, at the end of each, and the real tokens
    each consumed."""

    def __init__(self):
        self.first_step_begin: float | None = None
        self.step_end: list[float] = []
        self.tokens: list[int] = []
        self.loss: float | None = None

    def begin(self) -> None:
        if self.first_step_begin is None:
            self.first_step_begin = time.time()

    def step(self, tokens: int, loss: float | None = None) -> None:
        self.step_end.append(time.time())
        self.tokens.append(int(tokens))
        if loss is not None:
            self.loss = float(loss)

    def save(self) -> None:
        record = {
            "first_step_begin": self.first_step_begin,
            "step_end": self.step_end,
            "tokens": self.tokens,
            "loss": self.loss,
        }
        Path(os.environ["BENCH_STATS"]).write_text(json.dumps(record))


def step_figures(rate: str, ends: list[float], counts: list[int], loss: float, begin: float, run) -> dict:
    """A run's table figures from its step end times and the work done in each step (tokens or pairs):
    `rate` = work of steps 2.. / time from the end of step 1 to the last end, the median step, set-up
    (launch → `begin` of step 1), launch → end of step 1; `run` = (launch time, wall seconds, peak RSS MB)."""
    launched, wall, rss_mb = run
    return {
        rate: sum(counts[1:]) / (ends[-1] - ends[0]),
        "step_s": statistics.median(b - a for a, b in zip(ends, ends[1:])),
        "setup_s": begin - launched,
        "first_step_s": ends[0] - launched,
        "rss_mb": rss_mb,
        "loss": loss,
        "wall_s": wall,
    }


def write_results(path: Path, block: str, markers: tuple[str, str]) -> None:
    """Replace what lies between the RESULTS.md `markers` with `block`."""
    begin, end = markers
    text = path.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: the markers {begin} and {end} are missing; table not written")
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}\n{block}\n{end}{tail}")
