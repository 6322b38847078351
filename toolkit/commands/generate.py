"""`ftkit generate`: answer a prompt with a fine-tuned model directory (PEFT adapter or full model)."""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer

from toolkit.errors import UserError
from toolkit.export import ADAPTER_CONFIG
from toolkit.generation import chat_prompt_ids, greedy_answer
from toolkit.model import with_pad_token


def load_for_generation(path: Path):
    """(model, tokenizer) from an output's final/ or merged/ directory, or any HF model directory."""
    if not path.is_dir():
        raise UserError(f"--model: {path} is not a directory")
    if not (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file():
        raise UserError(f"--model: {path} holds no model ({ADAPTER_CONFIG} or config.json)")
    try:
        model, tokenizer = _load(path)
    except (OSError, ValueError, SafetensorError) as exc:
        raise UserError(f"--model: cannot load {path}: {str(exc).splitlines()[0]}") from None
    return model, tokenizer


def _load(path: Path):
    if (path / ADAPTER_CONFIG).is_file():
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(str(path))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path))
    return model.eval(), with_pad_token(AutoTokenizer.from_pretrained(str(path)))


def generate_cli(model_dir: str, prompt: str, max_new_tokens: int) -> str:
    model, tokenizer = load_for_generation(Path(model_dir))
    if not tokenizer.chat_template:
        raise UserError(f"--model: {model_dir} has no chat template; it was not saved by ftkit")
    return greedy_answer(model, tokenizer, chat_prompt_ids(tokenizer, prompt), max_new_tokens, synced=False)
