"""The trained embedding model as a sentence-transformers folder: the bare model's weights (an adapter
merged into its base) with its tokenizer, and beside them the modules that say how texts become vectors
(the transformer, the pooling, the normalisation), the maximum length and the query prefix as the
`query` prompt, so `SentenceTransformer(final)` embeds as ftkit does. Written by ftkit alone: the
sentence-transformers package is needed to load the folder, not to write it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from toolkit.checkpoint import export
from toolkit.embed.pooling import POOLING_CONFIG, ST_KEYS

ADAPTER = "adapter"
"""Where final/ keeps a LoRA run's adapter beside the merged model."""


def export_embedder(accelerator, model, tokenizer, cfg, output_dir: Path, pooling: str) -> Path:
    """Collective: output_dir/final as a sentence-transformers folder (a LoRA or QLoRA run's adapter merged
    in, the adapter itself kept in final/adapter)."""
    final = output_dir / "final"
    tokenizer.padding_side = "right"  # the last real token sits where pooling looks for it
    if cfg.model.method == "full":
        export.export_model(accelerator, model, tokenizer, final, cfg.export.dtype)
    else:
        adapter = output_dir / f"{final.name}.{ADAPTER}"
        export.export_model(accelerator, model, tokenizer, adapter, cfg.export.dtype)
        if accelerator.is_main_process:
            shutil.rmtree(final, ignore_errors=True)
            qlora = cfg.model.method == "qlora"
            export.merge_adapter(adapter, final, cfg.export.dtype, dequantized=qlora)
            adapter.rename(final / ADAPTER)
    if accelerator.is_main_process:
        write_modules(final, pooling, cfg.data.max_length, cfg.embed.query_prefix)
    accelerator.wait_for_everyone()
    return final


def write_modules(folder: Path, pooling: str, max_length: int, query_prefix: str) -> None:
    """sentence-transformers' description of the model saved in `folder`."""
    width = json.loads((folder / "config.json").read_text())["hidden_size"]
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    pooling_config = {"word_embedding_dimension": width, "include_prompt": True}
    pooling_config.update({key: mode == pooling for mode, key in ST_KEYS.items()})
    files = {
        "modules.json": modules,
        "sentence_bert_config.json": {"max_seq_length": max_length, "do_lower_case": False},
        POOLING_CONFIG: pooling_config,
        "config_sentence_transformers.json": {
            "model_type": "SentenceTransformer",
            "prompts": {"query": query_prefix, "document": ""},
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
    }
    (folder / "2_Normalize").mkdir(exist_ok=True)
    for name, content in files.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(json.dumps(content, indent=2) + "\n")
