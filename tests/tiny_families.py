"""Tiny random models of the 2026 families, built from transformers' own config classes on the embedded
tokenizer (vocab 2048): 2-4 layers, hidden 64, seconds each. A hybrid's layers alternate between its
linear-attention, convolution or Mamba kind and full attention, so both kinds are exercised."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "toolkit" / "assets" / "tiny-llama"

BASE = dict(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=3,
    max_position_embeddings=256,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
LINEAR_ATTENTION = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
# model_type -> the config's own keys beyond BASE (a text model's; a vision-language one's text part).
FAMILIES: dict[str, dict] = {
    "qwen3_5_text": dict(LINEAR_ATTENTION, layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_moe_text": dict(
        LINEAR_ATTENTION,
        **MOE,
        shared_expert_intermediate_size=64,
        layer_types=["linear_attention", "full_attention"],
    ),
    "qwen3_next": dict(
        LINEAR_ATTENTION,
        **MOE,
        shared_expert_intermediate_size=64,
        layer_types=["linear_attention", "full_attention"],
    ),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128),
    "deepseek_v3": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=16,
        qk_rope_head_dim=32,
        v_head_dim=16,
        head_dim=32,
        num_key_value_heads=4,
    ),
    "glm4_moe": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    ),
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmo3": dict(),
    "olmo_hybrid": dict(LINEAR_ATTENTION, layer_types=["linear_attention", "full_attention"]),
    "smollm3": dict(),
    "seed_oss": dict(attention_dropout=0.0, residual_dropout=0.0),
    "lfm2": dict(layer_types=["conv", "full_attention"], block_dim=64, block_ff_dim=128, conv_L_cache=3),
    "lfm3": dict(
        layer_types=["conv", "full_attention", "sliding_attention"], num_hidden_layers=3, sliding_window=8
    ),
    "nemotron_h": dict(
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        num_hidden_layers=4,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=1,
        chunk_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        moe_shared_expert_intermediate_size=64,
    ),
    "falcon_h1": dict(
        mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16
    ),
    "kimi_linear": dict(
        layer_types=["linear_attention", "full_attention"],
        num_key_value_heads=4,
        linear_head_dim=16,
        linear_num_heads=4,
        kv_lora_rank=64,
        q_lora_rank=None,
        qk_rope_head_dim=32,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
    ),
    "deepseek_v4": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        n_shared_experts=1,
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=8,
        sliding_window=8,
        num_nextn_predict_layers=0,
        hc_mult=2,
    ),
    "gemma4_text": dict(
        layer_types=["sliding_attention", "full_attention"],
        global_head_dim=32,
        vocab_size_per_layer_input=2048,
        hidden_size_per_layer_input=16,
        sliding_window=16,
    ),
    "mistral4": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        n_shared_experts=1,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=16,
        head_dim=64,
    ),
}


def tiny_config(model_type: str, **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**BASE, **FAMILIES[model_type], **overrides})


def tiny_family(path: Path, model_type: str, **overrides) -> Path:
    """A random `model_type` model saved at `path` with the embedded tokenizer beside it."""
    from toolkit.model.vision import auto_class

    torch.manual_seed(0)
    config = tiny_config(model_type, **overrides)
    auto_class(config.model_type).from_config(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, path / name)
    return path
