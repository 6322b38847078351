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

ST_TRANSFORMER = "sentence_transformers.models.Transformer"
ADAPTER = "adapter"
"""Where final/ keeps a LoRA run's adapter beside the merged model."""


def export_embedder(accelerator, model, tokenizer, cfg, output_dir: Path, pooling: str) -> Path:
    """Collective: output_dir/final as a sentence-transformers folder (a LoRA or QLoRA run's adapter merged
    in, the adapter itself kept in final/adapter)."""
    return _export(accelerator, model, tokenizer, cfg, output_dir, pooling)


def export_reranker(accelerator, model, tokenizer, cfg, output_dir: Path) -> Path:
    """Collective: output_dir/final as a folder sentence-transformers' CrossEncoder loads (a sequence
    classifier with one label, an adapter merged in and kept in final/adapter)."""
    return _export(accelerator, model, tokenizer, cfg, output_dir, None)


def export_classifier(accelerator, model, tokenizer, cfg, output_dir: Path) -> Path:
    """Collective: output_dir/final as a sequence classifier any tool loads (an adapter merged in and kept
    in final/adapter), its labels named as embed.labels names them."""
    return _export(accelerator, model, tokenizer, cfg, output_dir, None)


def _export(accelerator, model, tokenizer, cfg, output_dir: Path, pooling: str | None) -> Path:
    final = _write_weights(accelerator, model, tokenizer, cfg, output_dir)
    if accelerator.is_main_process:
        describe(final, cfg, pooling)
    accelerator.wait_for_everyone()
    return final


def describe(folder: Path, cfg, pooling: str | None) -> None:
    """What is read beside the weights in `folder`, by embed.task: sentence-transformers' modules (the
    pooling, `pooling`, and the query prompt), a cross-encoder's description, or a classifier's label names.
    Shared by the run's own export and `ftkit export` of one of its checkpoints."""
    if cfg.embed.task == "embedding":
        write_modules(folder, pooling, cfg.data.max_length, cfg.embed.query_prefix)
    elif cfg.embed.task == "reranker":
        write_cross_encoder(folder, cfg.data.max_length)
    else:
        config = json.loads((folder / "config.json").read_text())
        config["id2label"] = dict(enumerate(cfg.embed.labels))
        config["label2id"] = {label: i for i, label in enumerate(cfg.embed.labels)}
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _write_weights(accelerator, model, tokenizer, cfg, output_dir: Path) -> Path:
    """Collective: the trained weights whole in output_dir/final (an adapter merged into its base)."""
    final = output_dir / "final"
    tokenizer.padding_side = "right"  # the last real token sits where pooling looks for it
    if cfg.model.method == "full":
        export.export_model(accelerator, model, tokenizer, final, cfg.export.dtype)
        return final
    adapter = output_dir / f"{final.name}.{ADAPTER}"
    export.export_model(accelerator, model, tokenizer, adapter, cfg.export.dtype)
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        export.merge_adapter(adapter, final, cfg.export.dtype, dequantized=cfg.model.method == "qlora")
        adapter.rename(final / ADAPTER)
    return final


def write_cross_encoder(folder: Path, max_length: int) -> None:
    """sentence-transformers' description of the cross-encoder saved in `folder`: pairs read as text (not
    through the chat template), the head's logits as the score."""
    logits = {"method": "forward", "method_output_name": "logits"}
    files = {
        "modules.json": [{"idx": 0, "name": "0", "path": "", "type": ST_TRANSFORMER}],
        "sentence_bert_config.json": {
            "transformer_task": "sequence-classification",
            "modality_config": {"text": logits},
            "module_output_name": "scores",
            "max_seq_length": max_length,
        },
        "config_sentence_transformers.json": {"model_type": "CrossEncoder"},
    }
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content, indent=2) + "\n")


def write_modules(folder: Path, pooling: str, max_length: int, query_prefix: str) -> None:
    """sentence-transformers' description of the model saved in `folder`."""
    width = json.loads((folder / "config.json").read_text())["hidden_size"]
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": ST_TRANSFORMER},
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
