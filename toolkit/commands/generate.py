"""`ftkit generate`: answer a prompt with a fine-tuned model directory (PEFT adapter or full model)."""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError
from transformers import AutoTokenizer

from toolkit.checkpoint.export import ADAPTER_CONFIG, adapted_base
from toolkit.config import ModelConfig
from toolkit.data.images import resolve_image
from toolkit.errors import UserError
from toolkit.model import vision
from toolkit.model.load import model_class, remote_code_refusal, with_pad_token
from toolkit.train.generation import chat_prompt_ids, greedy_answer


def load_for_generation(path: Path, trust_remote_code: bool = False):
    """(model, tokenizer) from an output's final/ or merged/ directory, or any HF model directory; code
    shipped with the model runs only with `trust_remote_code` (the command line's)."""
    check_model_dir(path)
    try:
        return _load(path, trust_remote_code)
    except (OSError, ValueError, SafetensorError) as exc:
        if isinstance(exc, ValueError) and "trust_remote_code" in str(exc):
            raise UserError(f"--model: {path}: {remote_code_refusal(exc)}") from None
        raise UserError(f"--model: cannot load {path}: {str(exc).splitlines()[0]}") from None


def check_model_dir(path: Path) -> None:
    if not path.is_dir():
        raise UserError(f"--model: {path} is not a directory")
    if not (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file():
        raise UserError(f"--model: {path} holds no model ({ADAPTER_CONFIG} or config.json)")


def _load(path: Path, trust_remote_code: bool):
    if (path / ADAPTER_CONFIG).is_file():
        from peft import PeftModel

        base = adapted_base(path, trust_remote_code)
        model = PeftModel.from_pretrained(base, str(path))
    else:
        model = model_class(str(path)).from_pretrained(str(path), trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    return model.eval(), with_pad_token(tokenizer)


def generate_cli(
    model_dir: str,
    prompt: str,
    max_new_tokens: int,
    trust_remote_code: bool = False,
    images: list[str] | None = None,
) -> str:
    """The greedy answer to `prompt`, about `images` (paths) for a vision-language model."""
    model, tokenizer = load_for_generation(Path(model_dir), trust_remote_code)
    if not tokenizer.chat_template:
        raise UserError(f"--model: {model_dir} has no chat template; it was not saved by ftkit")
    source = ModelConfig(path=model_dir, trust_remote_code=trust_remote_code)
    seeing = vision.image_inputs(source, None, "--model")
    if images and seeing is None:
        raise UserError(f"--image: {model_dir} is a text-only model; it cannot read images")
    if not images:
        return greedy_answer(model, tokenizer, chat_prompt_ids(tokenizer, prompt), max_new_tokens, False)
    refs = [resolve_image(image, None, "--image") for image in images]
    ids, pixels = seeing.prompt(prompt, refs, "--image")
    return greedy_answer(model, tokenizer, ids, max_new_tokens, False, pixels)
