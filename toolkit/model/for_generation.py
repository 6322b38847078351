"""A fine-tuned model directory (a PEFT adapter or a full model) loaded to generate with: what `ftkit
generate`, `ftkit eval`, GRPO's reward models and the pair sampler share."""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError
from transformers import AutoTokenizer

from toolkit.checkpoint.export import ADAPTER_CONFIG, adapted_base
from toolkit.errors import UserError
from toolkit.model.load import model_class, remote_code_refusal, with_pad_token


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
