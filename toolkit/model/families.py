"""What a model family's layers are, read from its config: which of them attend and which carry a state along
the sequence (linear attention, short convolutions, Mamba), so how packed examples stay apart, which GPU
kernels the layers run on, and what a generating model caches per token or per sequence.

Transformers names each layer's kind in the config's `layer_types` (`layers_block_type` in some families,
remapped to it). Softmax attention (ATTENTION_LABELS) keeps each packed example to itself by its restarted
position ids; a recurrent kind whose module ftkit knows runs on each packed example alone
(toolkit/model/per_example.py). Compressed and sparse-indexed attention pool or pick keys across a packed
row, and a label known to no list is taken to carry state: packing is then refused rather than trained on
a silently wrong loss. Each family's verdict is checked by a packed-vs-alone test
(tests/unit/test_family_packing.py).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

FLA = "flash-linear-attention"
CAUSAL_CONV = "causal-conv1d"
MAMBA_SSM = "mamba-ssm"
# Kernel packages that compile CUDA code against the installed torch: `make install-gpu-kernels` builds them
# (toolkit/model/kernel_build.py); flash-linear-attention installs from a wheel (the `gpu` extra).
CUDA_BUILT = (CAUSAL_CONV, MAMBA_SSM)
# Each kernel package's import name.
KERNEL_MODULES = {FLA: "fla", CAUSAL_CONV: "causal_conv1d", MAMBA_SSM: "mamba_ssm"}


@dataclass(frozen=True)
class LayerKind:
    name: str
    """How messages and docs name it."""
    recurrent: bool
    """It carries a state from each token to the next: one packed example's state flows into the next one's,
    and a sequence cut across processes would lose it."""
    kernels: tuple[str, ...] = ()
    """The packages with its fast GPU kernels; without them transformers runs a slower PyTorch version."""
    state: Callable[[object], int] | None = None
    """Elements of the state one sequence keeps in one such layer while generating (from the text config)."""
    modules: tuple[str, ...] = ()
    """How the class names of transformers' modules of this kind end: ftkit runs each on every packed
    example's span alone (none: the kind cannot be run per example, and packing is refused)."""
    boundaries: bool = False
    """Transformers hands its GPU kernels the packed examples' boundaries (`cu_seq_lens_q`, `seq_idx`)."""
    positions: bool = False
    """Restarted position ids keep each packed example to itself (softmax attention)."""
    kept: Callable[[object], Kept] | None = None
    """What one such layer keeps per token for the backward pass on the GPU kernels' path (from the text
    config; `ftkit plan`'s activations): none, the plan counts it as attention."""

    @property
    def packs(self) -> bool:
        """Packed examples stay apart in it: by their position ids, or run one at a time."""
        return self.positions or bool(self.modules)


@dataclass(frozen=True)
class Kept:
    """Per token, what a recurrent layer's mixer keeps for the backward pass (its input norm and MLP are
    counted as any layer's): no sequence x sequence scores, a chunk kernel's per-chunk matrices instead."""

    compute: int
    """Elements in the compute dtype (projections, convolution outputs, gates, the mixer's output)."""
    fp32: int
    """Elements in float32 (decays, the chunk kernel's per-token matrices, the gated norm's upcast)."""
    inner: int
    """Width of the output projection's input (what LoRA dropout copies for it)."""


# Tokens per chunk of flash-linear-attention's chunked delta rules: each keeps a chunk x chunk float32
# matrix per head (its WY form) and recomputes the chunk states in backward.
FLA_CHUNK = 64


def _delta_net_kept(c) -> Kept:
    """Gated DeltaNet (flash-linear-attention's chunk_gated_delta_rule, causal-conv1d): the qkv projection
    (2K + V, the convolution's input) and the convolution's output, z, a and b, beta, the rule's output, the
    gated norm's gate and output (K = key heads x key size, V = value heads x value size, H value heads);
    in float32 the decay g, the WY matrix and the norm's upcast."""
    keys = c.linear_num_key_heads * c.linear_key_head_dim
    values, heads = c.linear_num_value_heads * c.linear_value_head_dim, c.linear_num_value_heads
    return Kept(4 * keys + 6 * values + 3 * heads, heads + FLA_CHUNK * heads + values, values)


def _kda_kept(c) -> Kept:
    """Kimi delta attention (chunk_kimi_delta_attention): q, k and v projections and their convolutions'
    outputs, the rule's output, the output gate and the norm's output (W = heads x head size, H heads,
    beta per head); in float32 the per-channel decay, the WY matrix and the norm's upcast."""
    width, heads = c.linear_num_heads * c.linear_head_dim, c.linear_num_heads
    return Kept(9 * width + heads, 2 * width + FLA_CHUNK * heads, width)


def _short_conv_kept(c) -> Kept:
    """Short convolution (LFM2): the projection's B, C and x, B x, the convolution's output and C times it."""
    return Kept(6 * c.hidden_size, 0, c.hidden_size)


def _mamba2_kept(c) -> Kept:
    """Mamba-2 (mamba-ssm's chunked scan): the input projection (z, x B C, dt), the convolution's output,
    the scan's output with and without its gate, the gated norm's output (I = heads x head size, G groups of
    state size N, H heads); in float32 dt and its cumulative decay, and the norm's upcast."""
    heads = _field(c, "mamba_num_heads", "mamba_n_heads", "n_mamba_heads", "num_heads")
    inner = heads * _field(c, "mamba_head_dim", "mamba_d_head", "mamba_headdim", "head_dim")
    groups = _field(c, "n_groups", "mamba_n_groups", "mamba_ngroups")
    bc = 2 * groups * _field(c, "ssm_state_size", "mamba_d_state", "state_size")
    return Kept(6 * inner + 2 * bc + heads, 2 * heads + inner, inner)


def _delta_net_state(c) -> int:
    heads_k, heads_v = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    return heads_v * dk * dv + (2 * heads_k * dk + heads_v * dv) * c.linear_conv_kernel_dim


def _kda_state(c) -> int:
    width = c.linear_num_heads * c.linear_head_dim
    return width * c.linear_head_dim + 3 * width * c.linear_conv_kernel_dim


def _short_conv_state(c) -> int:
    return c.hidden_size * c.conv_L_cache


def _mamba2_state(c) -> int:
    heads = _field(c, "mamba_num_heads", "mamba_n_heads", "n_mamba_heads", "num_heads")
    head_dim = _field(c, "mamba_head_dim", "mamba_d_head", "mamba_headdim", "head_dim")
    d_state = _field(c, "ssm_state_size", "mamba_d_state", "state_size")
    groups = _field(c, "n_groups", "mamba_n_groups", "mamba_ngroups")
    kernel = _field(c, "conv_kernel", "mamba_d_conv")
    return heads * head_dim * d_state + (heads * head_dim + 2 * groups * d_state) * kernel


def _field(config, *names: str) -> int:
    """The first of `names` the config sets: each Mamba-2 family names the same sizes its own way."""
    return next(int(getattr(config, n)) for n in names if getattr(config, n, None) is not None)


ATTENTION = LayerKind("attention", recurrent=False, positions=True)
# DeepSeek-V4 pools every few tokens into one compressed key, and an indexer picks keys from the pooled or
# whole row: a pooled key can hold two examples' tokens, whatever their positions.
COMPRESSED = LayerKind("compressed or sparse-indexed attention", recurrent=False)
GATED_DELTA_NET = LayerKind(
    "gated DeltaNet",
    True,
    (FLA, CAUSAL_CONV),
    _delta_net_state,
    ("GatedDeltaNet",),
    boundaries=True,
    kept=_delta_net_kept,
)
# Transformers never hands its kernel (chunk_kimi_delta_attention) the boundaries: always one at a time.
KIMI_DELTA = LayerKind(
    "Kimi delta attention", True, (FLA, CAUSAL_CONV), _kda_state, ("DeltaAttention",), kept=_kda_kept
)
LIGHTNING = LayerKind("lightning attention", True)
SHORT_CONV = LayerKind(
    "short convolution",
    True,
    (CAUSAL_CONV,),
    _short_conv_state,
    ("ShortConv",),
    boundaries=True,
    kept=_short_conv_kept,
)
MAMBA = LayerKind("Mamba", True, (MAMBA_SSM, CAUSAL_CONV))
MAMBA2 = LayerKind(
    "Mamba-2",
    True,
    (MAMBA_SSM, CAUSAL_CONV),
    _mamba2_state,
    ("Mamba2Mixer", "H1Mixer", "BambaMixer", "HybridMambaLayer", "Zamba2MambaMixer"),
    boundaries=True,
    kept=_mamba2_kept,
)
RG_LRU = LayerKind("RG-LRU recurrence", True)
RWKV = LayerKind("RWKV", True)
XLSTM = LayerKind("xLSTM", True)

# model_type -> the recurrent kind its non-attention layers ("linear_attention", "conv", the Mamba half of a
# "hybrid" layer) are; a model type without `layer_types` listed here is made of that kind alone.
LINEAR_KINDS: dict[str, LayerKind] = {
    "qwen3_next": GATED_DELTA_NET,
    "qwen3_5_text": GATED_DELTA_NET,
    "qwen3_5_moe_text": GATED_DELTA_NET,
    "olmo_hybrid": GATED_DELTA_NET,
    "kimi_linear": KIMI_DELTA,
    "minimax": LIGHTNING,
    "lfm2": SHORT_CONV,
    "lfm2_moe": SHORT_CONV,
    "lfm3": SHORT_CONV,
    "nemotron_h": MAMBA2,
    "falcon_h1": MAMBA2,
    "bamba": MAMBA2,
    "granitemoehybrid": MAMBA2,
    "zamba2": MAMBA2,
    "mamba2": MAMBA2,
    "jamba": MAMBA,
    "mamba": MAMBA,
    "falcon_mamba": MAMBA,
    "recurrent_gemma": RG_LRU,
    "rwkv": RWKV,
    "xlstm": XLSTM,
}
# Layer labels of softmax attention, full or within a window or chunk.
ATTENTION_LABELS = ("attention", "full_attention", "sliding_attention", "chunked_attention")
# Layer labels of attention over pooled keys or keys an indexer picks (DeepSeek-V4, DeepSeek-V3.2).
COMPRESSED_LABELS = ("compressed_sparse_attention", "heavily_compressed_attention", "indexed_attention")
# Layer labels of a block without a sequence mixer (Nemotron-H's MLP and MoE layers).
NO_MIXER = ("mlp", "moe")
# Layers that run attention and the family's recurrent kind side by side.
HYBRID = "hybrid"


@dataclass(frozen=True)
class Family:
    model_type: str
    """The language model's model_type (a vision-language model's text part)."""
    layers: tuple[tuple[LayerKind, ...], ...]
    """Each decoder layer's sequence mixers, in order (none: feed-forward only; two: a hybrid layer)."""
    latent_kv: int = 0
    """Multi-head latent attention's cache per token and attention layer (kv_lora_rank + qk_rope_head_dim;
    0: the layer caches K and V per key/value head)."""
    cache: tuple[tuple[int, int], ...] = ()
    """(elements per token, tokens kept) of each attention layer's cache while generating (tokens kept 0:
    every token; a sliding-window layer keeps its window's last tokens); layers that reuse an earlier
    layer's cache are left out."""

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        """Its distinct layer kinds, in order of first appearance."""
        return tuple(dict.fromkeys(kind for layer in self.layers for kind in layer))

    @property
    def recurrent(self) -> tuple[LayerKind, ...]:
        return tuple(kind for kind in self.kinds if kind.recurrent)

    @property
    def keeps_examples_apart(self) -> bool:
        """Whether every layer keeps packed examples from reaching each other (see LayerKind.packs)."""
        return all(kind.packs for kind in self.kinds)

    @property
    def leaks(self) -> LayerKind | None:
        """The first layer kind that would let one packed example reach another (None: packing is exact)."""
        return next((kind for kind in self.kinds if not kind.packs), None)

    @property
    def kernels(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(k for kind in self.kinds for k in kind.kernels))

    def count(self, kind: LayerKind) -> int:
        return sum(kind in layer for layer in self.layers)

    def describe(self) -> str:
        """Its layers in words: "18 gated DeltaNet + 6 attention layers"."""
        parts = [f"{self.count(kind)} {kind.name}" for kind in self.kinds]
        plain = sum(not layer for layer in self.layers)
        return " + ".join(parts + ([f"{plain} feed-forward-only"] if plain else [])) + " layers"

    def cache_elements(self, tokens: int) -> int:
        """Elements the attention layers cache for one sequence of `tokens` tokens."""
        return cache_elements(self.cache, tokens)

    def state_elements(self, text_config) -> int:
        """Elements one sequence's recurrent state takes across every recurrent layer while generating
        (0 where the family's kind has no formula here)."""
        return sum(self.count(kind) * kind.state(text_config) for kind in self.recurrent if kind.state)


def kernel_notes(family: Family | None, on_gpu: bool) -> list[str]:
    """A note naming the kernel packages a GPU run of `family` lacks (its layers then run transformers'
    slower PyTorch versions: the same results, more time and memory)."""
    if family is None or not on_gpu:
        return []
    missing = [name for name in family.kernels if importlib.util.find_spec(KERNEL_MODULES[name]) is None]
    if not missing:
        return []
    kinds = ", ".join(kind.name for kind in family.recurrent)
    return [
        f"{family.model_type}'s {kinds} layers run without {' and '.join(missing)} (not installed): "
        f"transformers' PyTorch versions give the same results, slower; {install_line(missing)}"
    ]


def install_line(missing: list[str]) -> str:
    """How to install kernel packages: pip for the wheels, make install-gpu-kernels for what compiles."""
    wheels = [name for name in missing if name not in CUDA_BUILT]
    built = [name for name in missing if name in CUDA_BUILT]
    fixes = [f"pip install {' '.join(wheels)}"] if wheels else []
    return "; ".join(fixes + ([f"make install-gpu-kernels (builds {' and '.join(built)})"] if built else []))


# Config keys of the dropout rates transformers applies while a model trains.
DROPOUT_KEYS = (
    "attention_dropout",
    "hidden_dropout",
    "residual_dropout",
    "embedding_dropout",
    "mlp_dropout",
    "dropout",
    "attn_pdrop",
    "resid_pdrop",
    "embd_pdrop",
)


def dropout_notes(raw: dict | None, processes: int) -> list[str]:
    """A note where the model's config turns dropout on and more than one process trains: transformers
    applies it as the config says, each process draws its own masks, so a step's loss depends on the
    random stream and equals one process's only in expectation."""
    text = (raw or {}).get("text_config") or raw or {}
    rates = [
        f"{key} {text[key]:g}"
        for key in DROPOUT_KEYS
        if isinstance(text.get(key), (int, float)) and not isinstance(text.get(key), bool) and text[key] > 0
    ]
    if not rates or processes < 2:
        return []
    return [
        f"the model's config trains with dropout ({', '.join(rates)}): each process draws its own masks, so "
        "per-step losses match one process's only in expectation (set the rates to 0 in its config.json for "
        "an exact match)"
    ]


def family_of(config) -> Family:
    """The family description of a transformers config (a vision-language model's language model)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = text.model_type
    labels = getattr(text, "layer_types", None)
    if labels is None:
        only = LINEAR_KINDS.get(model_type, ATTENTION)
        labels = ["linear_attention" if only.recurrent else "full_attention"] * text.num_hidden_layers
    layers = tuple(_mixers(label, model_type) for label in labels)
    rank = getattr(text, "kv_lora_rank", None)
    latent = rank + getattr(text, "qk_rope_head_dim", 0) if rank else 0
    own_cache = len(layers) - (getattr(text, "num_kv_shared_layers", 0) or 0)
    configs = layer_configs(text, len(layers))
    cache = tuple(
        (latent or 2 * _kv_width(configs[i]), _kept(labels[i], configs[i]))
        for i in range(own_cache)
        if any(not kind.recurrent for kind in layers[i])
    )
    return Family(model_type, layers, latent, cache)


def cache_elements(cache: tuple[tuple[int, int], ...], tokens: int) -> int:
    """Elements a `Family.cache` holds for one sequence of `tokens` tokens."""
    return sum(width * (min(tokens, kept) if kept else tokens) for width, kept in cache)


def _kept(label: str, layer_config) -> int:
    """Tokens a layer's cache keeps (0: all): transformers' sliding-window cache keeps window - 1."""
    window = getattr(layer_config, "sliding_window", None)
    return window - 1 if label == "sliding_attention" and window else 0


def layer_configs(text, count: int) -> list:
    """Each decoder layer's config: a heterogeneous config's own per-layer view (Gemma 4's full-attention
    layers have a head size of their own), else the config itself for every layer."""
    if getattr(text, "is_heterogeneous", False):
        return list(text.per_layer_config)
    return [text] * count


def widest(text, key: str) -> int | None:
    """The largest per-layer value of `key` (None where no layer sets it)."""
    values = [getattr(c, key, None) for c in layer_configs(text, 1)]
    return max((v for v in values if v is not None), default=None)


def _kv_width(layer_config) -> int:
    """K (or V) elements per token of one attention layer: key/value heads x head size."""
    heads = layer_config.num_attention_heads
    kv_heads = getattr(layer_config, "num_key_value_heads", None) or heads
    return kv_heads * (getattr(layer_config, "head_dim", None) or layer_config.hidden_size // heads)


def _mixers(label: str, model_type: str) -> tuple[LayerKind, ...]:
    if label in NO_MIXER:
        return ()
    recurrent = LINEAR_KINDS.get(model_type) or LayerKind(f"{label} ({model_type})", True)
    if label == HYBRID:
        return (ATTENTION, recurrent)
    if label in ATTENTION_LABELS:
        return (ATTENTION,)
    if label in COMPRESSED_LABELS:
        return (COMPRESSED,)
    return (recurrent,)
