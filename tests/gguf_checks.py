"""What the GGUF tests compare: greedy answers of the merged Hugging Face model and of llama.cpp running the
GGUF file (llama-cpp-python: llama.cpp's own library), and the prompt tokens each side builds."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MAX_NEW_TOKENS = 8


def questions(path: Path) -> list[list[dict]]:
    """Each held-out conversation up to (without) its final assistant answer."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row["messages"][:-1] for row in rows]


def training_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """As training and ftkit's evaluation tokenize: the rendered template, no special tokens added."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def hf_answers(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    answers = []
    for ids in prompts:
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        answers.append(_until_eos(out[0, len(ids) :].tolist(), {tokenizer.eos_token_id}))
    return answers


def load_gguf(path: Path, n_ctx: int = 256):
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=n_ctx, n_threads=2, seed=0, verbose=False, logits_all=False)


def gguf_answers(llm, prompts: list[list[int]], eos: set[int]) -> list[list[int]]:
    """Greedy (temperature 0) continuations, by llama.cpp's sampler, until an end token."""
    answers = []
    for ids in prompts:
        llm.reset()
        tokens = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if token in eos or len(tokens) == MAX_NEW_TOKENS:
                break
            tokens.append(token)
        answers.append(tokens)
    return answers


def gguf_prompt_ids(llm, messages: list[dict]) -> list[int]:
    """The prompt as llama-cpp-python's chat path builds it from the template inside the file: rendered
    (with the file's BOS and EOS token texts) and tokenized adding nothing, special tokens parsed."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    metadata = llm.metadata
    bos, eos = (
        llm.detokenize([int(metadata[key])], special=True).decode() if key in metadata else ""
        for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")
    )
    formatter = Jinja2ChatFormatter(metadata["tokenizer.chat_template"], eos, bos)
    rendered = formatter(messages=messages).prompt
    return llm.tokenize(rendered.encode(), add_bos=False, special=True)


def ollama_prompt_ids(llm, rendered: str) -> list[int]:
    """Ollama's way: its template's text (no BOS in it), tokenized adding BOS where the file says so."""
    add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token") == "true"
    return llm.tokenize(rendered.encode(), add_bos=add_bos, special=True)


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    return next((tokens[:i] for i, t in enumerate(tokens) if t in eos), tokens)


@torch.no_grad()
def near_ties(model_dir: Path, prompts: list[list[int]], got: list[list[int]], expected: list[list[int]]):
    """Where two greedy answers part, the merged model's logit gap between the two tokens (relative to its
    largest logit there): rounding to 16 bits can only decide a near tie."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    gaps = []
    for ids, a, b in zip(prompts, got, expected):
        if a == b:
            continue
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if at == min(len(a), len(b)):  # one answer stopped: compare with the end token
            return None
        logits = model(torch.tensor([ids + b[:at]])).logits[0, -1]
        gaps.append(float((logits[b[at]] - logits[a[at]]) / logits.abs().max()))
    return gaps
