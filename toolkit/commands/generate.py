"""`ftkit generate`: answer a prompt with a fine-tuned model directory (PEFT adapter or full model)."""

from __future__ import annotations

from pathlib import Path

from toolkit.config import ModelConfig
from toolkit.data.images import resolve_image
from toolkit.errors import UserError
from toolkit.model import vision
from toolkit.model.for_generation import load_for_generation
from toolkit.train.generation import chat_prompt_ids, greedy_answer


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
