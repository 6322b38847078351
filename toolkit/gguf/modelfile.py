"""The Ollama Modelfile written beside a GGUF file: the run's chat template in Ollama's template language
(Go's text/template over .Messages), the tokenizer's stop tokens and the run's context length.

Ollama adds the beginning-of-sequence token itself where the GGUF file asks for one, so no template here
writes it; a system message stays in .Messages (Ollama collates, it does not remove)."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = """{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""
# Qwen2.5's template opens with a default system turn when the conversation has none.
CHATML_DEFAULT_SYSTEM = """{{- if ne (index .Messages 0).Role "system" }}<|im_start|>system
%s<|im_end|>
{{ end }}"""
LLAMA3 = """{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>

{{ .Content }}<|eot_id|>
{{- end }}<|start_header_id|>assistant<|end_header_id|>

"""
# Gemma has no system turn: its template writes the system text, then a blank line, into the first user
# turn, and calls the assistant "model".
GEMMA3 = """{{- $system := "" }}
{{- range .Messages }}
{{- if eq .Role "system" }}{{ $system = printf "%s\\n\\n" .Content }}
{{- else if eq .Role "user" }}<start_of_turn>user
{{ $system }}{{ .Content }}<end_of_turn>
{{ $system = "" }}
{{- else }}<start_of_turn>model
{{ .Content }}<end_of_turn>
{{ end }}
{{- end }}<start_of_turn>model
"""
# Each family: the token its chat template marks turns with, its template here, its end-of-turn token.
FAMILIES = {
    "chatml": ("<|im_start|>", CHATML, "<|im_end|>"),
    "llama3": ("<|start_header_id|>", LLAMA3, "<|eot_id|>"),
    "gemma3": ("<start_of_turn>", GEMMA3, "<end_of_turn>"),
}


def family(chat_template: str) -> str | None:
    """The family whose turn markers the training chat template writes, or None."""
    return next((name for name, (mark, _, _) in FAMILIES.items() if mark in chat_template), None)


def ollama_template(tokenizer) -> str | None:
    """The training chat template in Ollama's language, or None where ftkit has none for its family
    (Ollama then reads the template the GGUF file carries, for the templates it knows)."""
    name = family(tokenizer.chat_template or "")
    if name is None:
        return None
    template = FAMILIES[name][1]
    if name == "chatml":
        default = _default_system(tokenizer)
        template = (CHATML_DEFAULT_SYSTEM % default if default else "") + template
    return template


def _default_system(tokenizer) -> str:
    """The system text a ChatML template adds to a conversation without one (Qwen2.5's), or ""."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    head = "<|im_start|>system\n"
    return text[len(head) : text.index("<|im_end|>")] if text.startswith(head) else ""


def stop_tokens(model_dir: Path, tokenizer) -> list[str]:
    """The tokens generation stops at: the end-of-sequence ids of generation_config.json and the tokenizer,
    and the family's end-of-turn token where the vocabulary has it."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    stops = [tokenizer.convert_ids_to_tokens(i) for i in sorted(ids)]
    name = family(tokenizer.chat_template or "")
    turn_end = FAMILIES[name][2] if name else None
    if turn_end and turn_end not in stops and turn_end in tokenizer.get_vocab():
        stops.append(turn_end)
    return stops


def modelfile(gguf_name: str, template: str | None, stops: list[str], num_ctx: int) -> str:
    lines = [f"FROM ./{gguf_name}"]
    if template is not None:
        lines.append(f'TEMPLATE """{template}"""')
    lines += [f"PARAMETER stop {json.dumps(stop)}" for stop in stops]
    lines.append(f"PARAMETER num_ctx {num_ctx}")
    return "\n".join(lines) + "\n"
