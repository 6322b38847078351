"""Built-in configs of common base models, so `ftkit plan` works offline and without downloading anything.

Each entry is the architecture part of the model's `config.json` on the Hugging Face hub (what decides the
parameter count and the activation shapes), keyed by every hub id that shares it: base and instruct variants
have the same shapes. The parameter count of each entry is the one the model card publishes; a test checks
that building the config on the meta device gives exactly that number, or, where the card publishes only a
rounded figure ("671B"), that figure when rounded alike.
"""

from __future__ import annotations

_LLAMA3 = dict(
    model_type="llama",
    vocab_size=128256,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)
_QWEN25 = dict(model_type="qwen2", rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768)
_GEMMA2 = dict(
    model_type="gemma2",
    vocab_size=256000,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    sliding_window=4096,
    final_logit_softcapping=30.0,
    attn_logit_softcapping=50.0,
)


def _layers(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, **extra) -> dict:
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **extra,
    )


# (hub ids, config dict, published parameter count: exact, or the card's rounded figure in billions)
_TABLE = [
    (
        (
            "meta-llama/Meta-Llama-3-8B",
            "meta-llama/Meta-Llama-3-8B-Instruct",
            "meta-llama/Llama-3.1-8B",
            "meta-llama/Llama-3.1-8B-Instruct",
            "meta-llama/Meta-Llama-3.1-8B",
            "meta-llama/Meta-Llama-3.1-8B-Instruct",
        ),
        {**_LLAMA3, **_layers(4096, 14336, 32, 32, 8)},
        8_030_261_248,
    ),
    (
        (
            "meta-llama/Meta-Llama-3-70B",
            "meta-llama/Meta-Llama-3-70B-Instruct",
            "meta-llama/Llama-3.1-70B",
            "meta-llama/Llama-3.1-70B-Instruct",
            "meta-llama/Llama-3.3-70B-Instruct",
        ),
        {**_LLAMA3, **_layers(8192, 28672, 80, 64, 8)},
        70_553_706_496,
    ),
    (
        ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B-Instruct"),
        {**_LLAMA3, **_layers(2048, 8192, 16, 32, 8, head_dim=64, tie_word_embeddings=True)},
        1_235_814_400,
    ),
    (
        ("meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.2-3B-Instruct"),
        {**_LLAMA3, **_layers(3072, 8192, 28, 24, 8, head_dim=128, tie_word_embeddings=True)},
        3_212_749_824,
    ),
    (
        ("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B-Instruct"),
        {**_QWEN25, "vocab_size": 151936, **_layers(896, 4864, 24, 14, 2, tie_word_embeddings=True)},
        494_032_768,
    ),
    (
        ("Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-1.5B-Instruct"),
        {**_QWEN25, "vocab_size": 151936, **_layers(1536, 8960, 28, 12, 2, tie_word_embeddings=True)},
        1_543_714_304,
    ),
    (
        ("Qwen/Qwen2.5-3B", "Qwen/Qwen2.5-3B-Instruct"),
        {**_QWEN25, "vocab_size": 151936, **_layers(2048, 11008, 36, 16, 2, tie_word_embeddings=True)},
        3_085_938_688,
    ),
    (
        ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct"),
        {**_QWEN25, "vocab_size": 152064, **_layers(3584, 18944, 28, 28, 4, tie_word_embeddings=False)},
        7_615_616_512,
    ),
    (
        ("Qwen/Qwen2.5-14B", "Qwen/Qwen2.5-14B-Instruct"),
        {**_QWEN25, "vocab_size": 152064, **_layers(5120, 13824, 48, 40, 8, tie_word_embeddings=False)},
        14_770_033_664,
    ),
    (
        ("Qwen/Qwen2.5-32B", "Qwen/Qwen2.5-32B-Instruct"),
        {**_QWEN25, "vocab_size": 152064, **_layers(5120, 27648, 64, 40, 8, tie_word_embeddings=False)},
        32_763_876_352,
    ),
    (
        ("Qwen/Qwen2.5-72B", "Qwen/Qwen2.5-72B-Instruct"),
        {**_QWEN25, "vocab_size": 152064, **_layers(8192, 29568, 80, 64, 8, tie_word_embeddings=False)},
        72_706_203_648,
    ),
    (
        (
            "mistralai/Mistral-7B-v0.1",
            "mistralai/Mistral-7B-Instruct-v0.1",
            "mistralai/Mistral-7B-Instruct-v0.2",
        ),
        dict(model_type="mistral", vocab_size=32000, rope_theta=10000.0, **_layers(4096, 14336, 32, 32, 8)),
        7_241_732_096,
    ),
    (
        ("mistralai/Mistral-7B-v0.3", "mistralai/Mistral-7B-Instruct-v0.3"),
        dict(model_type="mistral", vocab_size=32768, rope_theta=1000000.0, **_layers(4096, 14336, 32, 32, 8)),
        7_248_023_552,
    ),
    (
        ("google/gemma-2-2b", "google/gemma-2-2b-it"),
        {**_GEMMA2, **_layers(2304, 9216, 26, 8, 4, query_pre_attn_scalar=256)},
        2_614_341_888,
    ),
    (
        ("google/gemma-2-9b", "google/gemma-2-9b-it"),
        {**_GEMMA2, **_layers(3584, 14336, 42, 16, 8, query_pre_attn_scalar=256)},
        9_241_705_984,
    ),
    (
        ("google/gemma-2-27b", "google/gemma-2-27b-it"),
        {**_GEMMA2, **_layers(4608, 36864, 46, 32, 16, head_dim=128, query_pre_attn_scalar=144)},
        27_227_128_320,
    ),
    # Mixtures of experts: 128, 32 and 8 routed experts a layer, 8, 4 and 2 of them per token.
    (
        ("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B-Base", "Qwen/Qwen3-30B-A3B-Instruct-2507"),
        dict(
            model_type="qwen3_moe",
            vocab_size=151936,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=40960,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            router_aux_loss_coef=0.001,
            **_layers(2048, 6144, 48, 32, 4, head_dim=128, tie_word_embeddings=False),
        ),
        30_532_122_624,
    ),
    (
        ("openai/gpt-oss-20b",),
        dict(
            model_type="gpt_oss",
            vocab_size=201088,
            sliding_window=128,
            num_local_experts=32,
            num_experts_per_tok=4,
            router_aux_loss_coef=0.9,
            **_layers(2880, 2880, 24, 64, 8, head_dim=64, tie_word_embeddings=False),
        ),
        20_914_757_184,
    ),
    (
        ("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-Instruct-v0.1"),
        dict(
            model_type="mixtral",
            vocab_size=32000,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
            num_local_experts=8,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.02,
            **_layers(4096, 14336, 32, 32, 8, tie_word_embeddings=False),
        ),
        46_702_792_704,
    ),
    # Vision-language models: the language model's config in text_config, the tower's in vision_config (the
    # projector's shape follows from the two); the published count is the whole model's.
    (
        ("Qwen/Qwen2.5-VL-7B-Instruct",),
        dict(
            model_type="qwen2_5_vl",
            tie_word_embeddings=False,
            text_config={
                **_QWEN25,
                "model_type": "qwen2_5_vl_text",
                "vocab_size": 152064,
                "max_position_embeddings": 128000,
                **_layers(3584, 18944, 28, 28, 4, tie_word_embeddings=False),
            },
            vision_config=dict(
                depth=32,
                hidden_size=1280,
                intermediate_size=3420,
                num_heads=16,
                out_hidden_size=3584,
                patch_size=14,
                spatial_merge_size=2,
                temporal_patch_size=2,
                window_size=112,
                fullatt_block_indexes=[7, 15, 23, 31],
            ),
        ),
        8_292_166_656,
    ),
    (
        ("google/gemma-3-12b-it", "google/gemma-3-12b-pt"),
        dict(
            model_type="gemma3",
            mm_tokens_per_image=256,
            text_config=dict(
                model_type="gemma3_text",
                vocab_size=262208,
                head_dim=256,
                sliding_window=1024,
                max_position_embeddings=131072,
                query_pre_attn_scalar=256,
                rope_scaling={"rope_type": "linear", "factor": 8.0},
                **_layers(3840, 15360, 48, 16, 8, tie_word_embeddings=True),
            ),
            vision_config=dict(
                model_type="siglip_vision_model",
                hidden_size=1152,
                intermediate_size=4304,
                num_hidden_layers=27,
                num_attention_heads=16,
                image_size=896,
                patch_size=14,
                vision_use_head=False,
            ),
        ),
        12_187_325_040,
    ),
    # Multi-head latent attention: each layer caches a 512 + 64 latent per token instead of K and V per head.
    # The card publishes 671B; the hub's 685B adds the 14B multi-token-prediction layer, which transformers
    # does not build.
    (
        (
            "deepseek-ai/DeepSeek-V3",
            "deepseek-ai/DeepSeek-V3-Base",
            "deepseek-ai/DeepSeek-V3-0324",
            "deepseek-ai/DeepSeek-R1",
        ),
        dict(
            model_type="deepseek_v3",
            vocab_size=129280,
            moe_intermediate_size=2048,
            n_routed_experts=256,
            n_shared_experts=1,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=3,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=163840,
            rope_scaling={
                "type": "yarn",
                "factor": 40,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            **_layers(7168, 18432, 61, 128, 128, tie_word_embeddings=False),
        ),
        "671B",
    ),
    # A hybrid: three gated DeltaNet (linear attention) layers to one attention layer. The checkpoint is a
    # vision-language model; this is its language model, what text fine-tuning trains (the vision tower,
    # about 0.4B frozen parameters, is not counted). Published as 35B, 3B active.
    (
        ("Qwen/Qwen3.5-35B-A3B",),
        dict(
            model_type="qwen3_5_moe_text",
            vocab_size=248320,
            head_dim=256,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            num_experts=256,
            num_experts_per_tok=8,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            max_position_embeddings=262144,
            rms_norm_eps=1e-6,
            hidden_size=2048,
            num_hidden_layers=40,
            num_attention_heads=16,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        ),
        "35B",
    ),
    # Dense hybrids and Gemma-4, each the language model of its checkpoint (the vision tower is not counted,
    # as above). Qwen3.5-9B: the text_config of the hub's config.json (revision c202236), as copied into
    # public test fixtures that check it against the checkpoint; the card's layout is 8 x (3 gated DeltaNet +
    # 1 gated attention), 9B. It counts 8.95B, as GGUF conversions report; untied embeddings.
    (
        ("Qwen/Qwen3.5-9B",),
        dict(
            model_type="qwen3_5_text",
            vocab_size=248320,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            max_position_embeddings=262144,
            rms_norm_eps=1e-6,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8,
            **_layers(4096, 12288, 32, 16, 4, tie_word_embeddings=False),
        ),
        "9B",
    ),
    # Gemma-4-31B: the text_config of gemma-4-31B-it's config.json (transformers 5.7.0), as dumped with its
    # tensor shapes in a public model report; the meta build gives those shapes (sliding layers: 16 kv heads
    # of 256; every sixth layer global: 4 kv heads of 512, keys reused as values). Published as 31B.
    (
        ("google/gemma-4-31B-it", "google/gemma-4-31B"),
        dict(
            model_type="gemma4_text",
            vocab_size=262144,
            vocab_size_per_layer_input=262144,
            head_dim=256,
            global_head_dim=512,
            num_global_key_value_heads=4,
            attention_k_eq_v=True,
            hidden_size_per_layer_input=0,
            num_kv_shared_layers=0,
            enable_moe_block=False,
            hidden_activation="gelu_pytorch_tanh",
            final_logit_softcapping=30.0,
            sliding_window=1024,
            max_position_embeddings=262144,
            rms_norm_eps=1e-6,
            layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10,
            **_layers(5376, 21504, 60, 32, 16, tie_word_embeddings=True),
        ),
        "31B",
    ),
    # Nemotron-H-8B: 24 Mamba-2, 24 feed-forward and 4 attention blocks. transformers' NemotronHConfig
    # documents these values as its defaults, which are this checkpoint's; Megatron-Bridge's
    # NemotronHConfig8B and TensorRT-LLM's test config of it agree. Published as 8B.
    (
        ("nvidia/Nemotron-H-8B-Base-8K",),
        dict(
            model_type="nemotron_h",
            vocab_size=131072,
            hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
            mamba_num_heads=128,
            mamba_head_dim=64,
            ssm_state_size=128,
            n_groups=8,
            conv_kernel=4,
            expand=2,
            head_dim=128,
            mlp_hidden_act="relu2",
            layer_norm_epsilon=1e-5,
            max_position_embeddings=8192,
            **_layers(4096, 21504, 52, 32, 8, tie_word_embeddings=False),
        ),
        "8B",
    ),
]

ARCHITECTURES: dict[str, dict] = {name.lower(): config for names, config, _ in _TABLE for name in names}
"""Lower-cased hub id -> config dict (`transformers.AutoConfig.for_model(**config)` builds it)."""
PUBLISHED_PARAMS: dict[str, int | str] = {names[0]: count for names, _, count in _TABLE}
"""First hub id of each entry -> its published parameter count (exact, or rounded: "671B")."""


def lookup(model_id: str) -> dict | None:
    """The built-in config dict for a hub id (case-insensitive), or None when the table does not have it."""
    config = ARCHITECTURES.get(model_id.strip().lower())
    return dict(config) if config is not None else None


def known_ids() -> list[str]:
    """The first hub id of each entry, for error messages."""
    return list(PUBLISHED_PARAMS)
