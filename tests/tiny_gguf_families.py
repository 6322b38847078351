"""Tiny random models of two families with their family's tokenizer layout (split pattern, special tokens,
BOS policy, chat template), built offline from the embedded tokenizer's vocabulary, and the families'
published chat templates; Go's text/template to render Ollama templates with."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import REPO
from tokenizers import Regex, Tokenizer, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from toolkit.gguf.convert import SPLIT_PATTERNS

DEMO_TOKENIZER = REPO / "toolkit" / "assets" / "tiny-llama"
# The families' published templates, their tool branches left out (no conversation here has tools).
QWEN25 = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.'
        + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
        or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
QWEN3 = """{%- for message in messages %}
    {%- if message.role == "user" or message.role == "system" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim -}}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""
LLAMA3_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
FAMILY_PRE = {"qwen2": "qwen2", "llama3": "llama-bpe"}


def tiny_gguf_family(path: Path, family: str) -> Path:
    """A random `family` model (2 layers, hidden 64) saved at `path` with its family's tokenizer."""
    tokenizer = _qwen_tokenizer() if family == "qwen2" else _llama3_tokenizer()
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # Wide weights: peaked logits, so that f16 rounding does not decide a near tie.
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _qwen_tokenizer():
    """The embedded tokenizer is Qwen2's layout already (split pattern, byte level, ChatML tokens)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(DEMO_TOKENIZER))
    tokenizer.chat_template = QWEN25
    return tokenizer


def _llama3_tokenizer():
    """Llama-3's layout: its split pattern (digits in threes), its header and turn tokens, a BOS that the
    tokenizer adds and the template writes."""
    backend = Tokenizer.from_file(str(DEMO_TOKENIZER / "tokenizer.json"))
    pattern = next(p for p, name in SPLIT_PATTERNS.items() if name == "llama-bpe")
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.add_special_tokens(LLAMA3_SPECIAL)
    bos = "<|begin_of_text|>"
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0",
        pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, backend.token_to_id(bos))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token="<|eot_id|>",
        pad_token="<|pad|>",
        chat_template=LLAMA3,
    )


def go_renderer(folder: Path):
    """render(template, messages) -> text, by Go's text/template over Ollama's chat values."""
    if shutil.which("go") is None:
        pytest.skip("Go is not installed: the Modelfile templates are rendered with Go's text/template")
    binary = folder / "ollama-template"
    subprocess.run(
        ["go", "build", "-o", str(binary), "."], cwd=REPO / "tests" / "ollama_template", check=True
    )

    def render(template: str, messages: list[dict]) -> str:
        payload = json.dumps({"template": template, "messages": messages})
        return subprocess.run([str(binary)], input=payload, capture_output=True, text=True, check=True).stdout

    return render
