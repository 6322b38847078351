"""Tiny random vision-language models of the 2026 families, each saved to a folder with its processor the
way their hub checkpoints are laid out, from transformers' own config and processor classes, offline, on
the embedded tokenizer (toolkit/assets/tiny-llama) with each family's special tokens added.

Qwen3.5 and Qwen3.5-MoE: a 2-block vision tower on 16-pixel patches merged 2 x 2 (a 56-pixel image is
resized to 64 x 64: 4 tokens), and a hybrid text model of one gated DeltaNet (linear attention) layer and
one full attention layer; the MoE one routes 4 experts, 2 per token, beside a shared expert.

Gemma-4: a 2-layer vision tower on 4-pixel patches pooled 3 x 3 (a 56-pixel image is resized to 96 x 96:
64 soft tokens), a 1-layer audio tower, and a text model of one sliding and one full attention layer with
per-layer input embeddings, its full attention layer on wider heads (a per-layer config); the MoE one (the
26B-A4B layout) adds 4 routed experts, 2 per token, beside each layer's MLP."""

from __future__ import annotations

import json
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "toolkit" / "assets" / "tiny-llama"

QWEN_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- elif part['type'] == 'text' %}"
    "{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen's template in short: an image part is `<|vision_start|><|image_pad|><|vision_end|>`, whose image pad
the processor repeats once per merged patch."""

QWEN_TOWER = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=64,
    num_position_embeddings=64,
)
QWEN_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    max_position_embeddings=512,
    # Qwen3.5's rotary layout scaled down: a quarter of each head rotates, its 4 frequencies interleaved
    # over time, height and width.
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
)
QWEN_MOE = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
)


def tiny_qwen3_5(path: Path, moe: bool = False) -> Path:
    """A random Qwen3.5 (`moe`: Qwen3.5-MoE) with its processor's parts at `path`."""
    import transformers
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VISION_TOKENS})
    ids = tokenizer.convert_tokens_to_ids(QWEN_VISION_TOKENS)
    text = dict(
        QWEN_TEXT,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **(QWEN_MOE if moe else {}),
    )
    name = "Qwen3_5Moe" if moe else "Qwen3_5"
    config = getattr(transformers, f"{name}Config")(
        text_config=text,
        vision_config=QWEN_TOWER,
        vision_start_token_id=ids[0],
        vision_end_token_id=ids[1],
        image_token_id=ids[2],
        video_token_id=ids[3],
    )
    torch.manual_seed(0)
    getattr(transformers, f"{name}ForConditionalGeneration")(config).save_pretrained(path)
    images = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=128 * 128
    )
    tokenizer.chat_template = QWEN_TEMPLATE
    # Saved part by part: without torchvision the processor cannot save its (absent) video processor.
    images.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_qwen3_5_moe(path: Path) -> Path:
    return tiny_qwen3_5(path, moe=True)


GEMMA4_TOKENS = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
}
GEMMA4_MORE_TOKENS = ["<|turn>", "<turn|>", "<|video|>"]
"""Its turn markers, and the video placeholder its processor adds (in the vocabulary, as on the hub)."""
GEMMA4_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<|turn>' + role + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] | trim }}{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|image|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] | trim }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<turn|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|turn>model\\n' }}{%- endif %}"
)
"""Gemma-4's turns in short (no system folding, no thinking): an image part is the placeholder `<|image|>`,
which the processor expands into `<|image>`, the image's soft tokens and `<image|>`."""

GEMMA4_TOWER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    patch_size=4,
    pooling_kernel_size=3,
    position_embedding_size=64,
)
GEMMA4_AUDIO = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    subsampling_conv_channels=[8, 4],
    output_proj_dims=32,
)
GEMMA4_SOFT_TOKENS = 70
"""The image processor's budget of soft tokens per image (the smallest Gemma-4 allows)."""


GEMMA4_MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
"""Gemma-4 26B-A4B's layout scaled down: each layer's MLP beside 4 routed experts, 2 per token."""


def tiny_gemma4(path: Path, moe: bool = False) -> Path:
    """A random Gemma-4 (`moe`: with routed experts in every layer) with its processor's parts at `path`."""
    from transformers import (
        AutoTokenizer,
        Gemma4AudioFeatureExtractor,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4ImageProcessorPil,
    )

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER, extra_special_tokens=GEMMA4_TOKENS)
    tokenizer.add_special_tokens({"additional_special_tokens": GEMMA4_MORE_TOKENS})
    text = dict(
        vocab_size=len(tokenizer),
        vocab_size_per_layer_input=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        hidden_size_per_layer_input=16,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=512,
        use_bidirectional_attention="vision",
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **(GEMMA4_MOE if moe else {}),
    )
    config = Gemma4Config(
        text_config=text,
        vision_config=GEMMA4_TOWER,
        audio_config=GEMMA4_AUDIO,
        image_token_id=tokenizer.image_token_id,
        boi_token_id=tokenizer.boi_token_id,
        eoi_token_id=tokenizer.eoi_token_id,
        audio_token_id=tokenizer.audio_token_id,
        boa_token_id=tokenizer.boa_token_id,
        eoa_token_index=tokenizer.eoa_token_id,
        video_token_id=tokenizer.convert_tokens_to_ids("<|video|>"),
    )
    torch.manual_seed(0)
    Gemma4ForConditionalGeneration(config).save_pretrained(path)
    images = Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=3, max_soft_tokens=GEMMA4_SOFT_TOKENS)
    # The hub's layout: the image processor and the audio feature extractor in processor_config.json. Written
    # by hand, since without torchvision the processor cannot be built with its video processor to save.
    processor = {
        "processor_class": "Gemma4Processor",
        "image_processor": json.loads(images.to_json_string()),
        "feature_extractor": json.loads(Gemma4AudioFeatureExtractor().to_json_string()),
        "video_processor": {"video_processor_type": "Gemma4VideoProcessor", "patch_size": 4},
        "image_seq_length": GEMMA4_SOFT_TOKENS,
    }
    (path / "processor_config.json").write_text(json.dumps(processor, indent=2, sort_keys=True) + "\n")
    tokenizer.chat_template = GEMMA4_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def tiny_gemma4_moe(path: Path) -> Path:
    return tiny_gemma4(path, moe=True)
