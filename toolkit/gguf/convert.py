"""Runs llama.cpp's convert_hf_to_gguf.py in its own process: `python -m toolkit.gguf.convert LLAMA_CPP_DIR
ARGS...`, where ARGS are the converter's. Two things are added around it: an architecture the converter does
not know exits with UNSUPPORTED and one line naming it and the families it does know, and a BPE tokenizer
whose fingerprint the converter does not recognise is identified by its pre-tokenizer's split pattern."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

UNSUPPORTED = 3
"""Exit status of an architecture or tokenizer the converter cannot convert (its one line on stdout)."""
# The converter names a BPE pre-tokenizer by hashing what the tokenizer makes of a fixed text, which depends
# on the whole vocabulary: a model whose vocabulary was trimmed or retrained keeps its family's split pattern
# but loses the hash. These are the patterns of llama.cpp's llama-vocab.cpp ("original regex from
# tokenizer.json") for the families ftkit ships configs for.
SPLIT_PATTERNS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen35",
}
# The text architectures of the families ftkit ships configs for, named when another one is refused.
FTKIT_FAMILIES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma4ForCausalLM",
    "GptOssForCausalLM",
)


def split_pattern_name(model_dir: Path) -> str | None:
    """llama.cpp's name for the tokenizer's pre-tokenizer, read from its split pattern, or None."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    pre = json.loads(path.read_text(encoding="utf-8")).get("pre_tokenizer") or {}
    for step in pre.get("pretokenizers", [pre]):
        pattern = (step.get("pattern") or {}).get("Regex") if step.get("type") == "Split" else None
        if pattern in SPLIT_PATTERNS:
            return SPLIT_PATTERNS[pattern]
    return None


def main(argv: list[str]) -> int:
    llama_dir, args = Path(argv[0]), argv[1:]
    sys.path[:0] = [str(llama_dir), str(llama_dir / "gguf-py")]
    import conversion
    from conversion import base

    model_dir = Path(args[-1])
    architecture = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    if architecture not in conversion.TEXT_MODEL_MAP:
        known = [name for name in FTKIT_FAMILIES if name in conversion.TEXT_MODEL_MAP]
        print(
            f"{architecture} is not an architecture llama.cpp's converter knows; it knows {', '.join(known)}"
        )
        return UNSUPPORTED
    by_hash = base.TextModel.get_vocab_base_pre

    def by_hash_or_pattern(self, tokenizer) -> str:
        try:
            return by_hash(self, tokenizer)
        except NotImplementedError:
            name = split_pattern_name(Path(self.dir_model))
            if name is None:
                print(
                    "the tokenizer's pre-tokenizer is neither one llama.cpp's converter recognises nor a "
                    "Llama-3, Qwen2.5/3 or Qwen3.5 split pattern"
                )
                sys.exit(UNSUPPORTED)
            return name

    base.TextModel.get_vocab_base_pre = by_hash_or_pattern
    sys.argv = [str(llama_dir / "convert_hf_to_gguf.py"), *args]
    runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
