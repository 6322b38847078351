"""Preference pairs from a policy's own samples (`ftkit sample-pairs`): for each prompt of SFT data, its
reference answer against each distinct wrong answer the policy samples.

A reward model trained only on hand-made mistakes scores what it has seen; GRPO then finds answers it
overrates. Pairs built from the mistakes the policy actually makes, at the temperature GRPO samples at,
show the reward model those answers (the usual remedy in RLHF: comparisons of on-policy samples).
Sampling is GRPO's own (`toolkit/grpo/sampling.py`): seeded per prompt and sample, so a run repeats.
"""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.data.formats import detect_format, to_example
from toolkit.data.sources import read_source
from toolkit.errors import UserError
from toolkit.grpo.config import GrpoConfig
from toolkit.grpo.sampling import completion_seed, sample
from toolkit.preference.data import render_answer

PROMPTS_PER_BATCH = 32


def read_prompts(path: str) -> list[tuple[list[dict], str, str]]:
    """(prompt turns, reference answer, where) of every record of an SFT file: the last turn is the
    answer and must be the assistant's text."""
    prompts = []
    for chunk in read_source(path, "train").read(1000):
        for i, record in enumerate(chunk.records()):
            where = chunk.where(i)
            example = to_example(record, detect_format(record, where), where)
            messages = example["messages"]
            if example["images"] or not messages or messages[-1]["role"] != "assistant":
                raise UserError(f"{where}: needs text turns ending with the assistant's answer")
            if not isinstance(messages[-1]["content"], str) or len(messages) < 2:
                raise UserError(f"{where}: needs a prompt and a text answer")
            prompts.append((messages[:-1], messages[-1]["content"], where))
    if not prompts:
        raise UserError(f"{path}: holds no records")
    return prompts


def wrong_answers(answer: str, samples: list[str]) -> list[str]:
    """The distinct non-empty samples, stripped, that differ from `answer`, in the order first sampled."""
    seen, wrong = {answer.strip(), ""}, []
    for text in samples:
        text = text.strip()
        if text not in seen:
            seen.add(text)
            wrong.append(text)
    return wrong


def sample_pairs(model, tokenizer, prompts, samples: int, temperature: float, max_new_tokens: int, seed: int):
    """One pair record per wrong answer: {prompt, chosen (the reference), rejected (the sample)}."""
    settings = GrpoConfig(num_generations=samples, temperature=temperature, max_new_tokens=max_new_tokens)
    records, indexed = [], list(enumerate(prompts))
    for start in range(0, len(prompts), PROMPTS_PER_BATCH):
        batch = indexed[start : start + PROMPTS_PER_BATCH]
        ids, seeds = [], []
        for index, (turns, answer, where) in batch:
            text, _ = render_answer(tokenizer, turns, [{"role": "assistant", "content": answer}], where)
            ids += [tokenizer(text, add_special_tokens=False)["input_ids"]] * samples
            seeds += [completion_seed(seed, 0, index, index, g) for g in range(samples)]
        completions = sample(
            model, ids, seeds, settings, tokenizer.pad_token_id, tokenizer.eos_token_id, False
        )
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        for k, (_, (turns, answer, _)) in enumerate(batch):
            for wrong in wrong_answers(answer, texts[k * samples : (k + 1) * samples]):
                records.append({"prompt": turns, "chosen": answer, "rejected": wrong})
    return records


def sample_pairs_cli(
    model_dir: str, data: str, out: str, samples: int, temperature: float, max_new_tokens: int, seed: int
) -> str:
    """Writes the pairs of `model_dir`'s samples on `data`'s prompts to `out` (JSON lines, a new file,
    appearing whole or not at all); says how many."""
    from toolkit.model.for_generation import load_for_generation

    if samples < 1 or temperature <= 0 or max_new_tokens < 1:
        raise UserError("--samples and --max-new-tokens must be at least 1, --temperature above 0")
    target = Path(out)
    if target.exists():
        raise UserError(f"{out}: already exists; ftkit never replaces a file, name a new one with --out")
    prompts = read_prompts(data)
    model, tokenizer = load_for_generation(Path(model_dir))
    records = sample_pairs(model, tokenizer, prompts, samples, temperature, max_new_tokens, seed)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    with open(partial, "x") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in records)
    partial.rename(target)
    wrong = len({json.dumps(r["prompt"]) for r in records})
    return f"{len(records)} pairs from {wrong} of {len(prompts)} prompts with a wrong sample: {out}"
