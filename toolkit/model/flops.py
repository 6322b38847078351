"""Training FLOPs per token with LoRA-correct accounting, and model FLOPs utilisation (MFU) of a run."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit.model import moe
from toolkit.model.families import layer_configs

# Peak dense bf16 tensor-core FLOP/s (fp32 accumulate), never the 2:4-sparse figure vendors headline.
# Each entry: substrings that must all appear in the upper-cased device name; the first match wins.
PEAK_BF16_FLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H100", "PCIE"), 756e12),
    (("H100", "NVL"), 835e12),
    (("H100",), 989e12),
    (("H200",), 989e12),
    (("A100",), 312e12),
    (("L40S",), 362e12),
    (("L40",), 181e12),
    (("L4",), 121e12),
    (("RTX 4090",), 165e12),
    (("RTX 3090",), 71e12),
    (("A6000",), 155e12),
)


def training_flops_per_token(
    matmul_frozen: int, matmul_trainable: int, layers: int, seq_len: int, attn_dim: int
) -> int:
    """FLOPs to train on one token of a causal LM (model FLOPs: gradient-checkpoint recompute not counted).

    Weights of matrix multiplications (linear layers, routers and the output head; of a mixture of experts'
    routed experts only the share a token is sent to, `toolkit.model.moe`), 2 FLOPs (multiply, add) a weight:
        forward                          2 per weight, frozen or trainable
        backward, input gradient         2 per weight, frozen too: it carries the gradient to earlier adapters
        backward, weight gradient        2 per trainable weight only
        => 4 * frozen + 6 * trainable    (full fine-tuning: the classic 6N)
    Attention scores have no weights. Per layer and token the forward pass does QK^T and AV, each
    2 * seq * attn_dim (attn_dim = heads x head_dim); the backward pass costs twice the forward:
        => 3 * 2 * 2 * seq * attn_dim * layers = 12 * layers * seq * attn_dim
    counted over the whole seq x seq score matrix (causal masking ignored), the PaLM MFU convention, so
    numbers compare with other tools. Ignored (well under 1%): norms, activations, softmax, rotary
    embeddings, the loss, the embedding lookup, and the input gradient the first layer does not need.
    """
    return 4 * matmul_frozen + 6 * matmul_trainable + 12 * layers * seq_len * attn_dim


def flops_per_token(counts, seq_len: int) -> int:
    """`training_flops_per_token` for a `plan.counts.ModelCounts`."""
    return training_flops_per_token(
        counts.matmul_frozen, counts.matmul_trainable, counts.layers, seq_len, counts.heads * counts.head_dim
    )


def peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of one device named like `torch.cuda.get_device_name()`, or None if unknown."""
    name = device_name.upper()
    for parts, peak in PEAK_BF16_FLOPS:
        if all(part in name for part in parts):
            return peak
    return None


def mfu(tokens_per_s: float, flops_per_token: int, device_name: str | None, n_devices: int) -> float | None:
    """Model FLOPs utilisation: achieved training FLOP/s over the peak of `n_devices` devices.

    `tokens_per_s` is the whole run's throughput (all devices). None on CPU or an unknown device.
    """
    peak = peak_flops(device_name) if device_name else None
    if peak is None or n_devices < 1:
        return None
    return tokens_per_s * flops_per_token / (peak * n_devices)


@dataclass(frozen=True)
class ModelShape:
    """What `training_flops_per_token` needs from a loaded model; read it before `prepare` shards weights."""

    matmul_frozen: int
    matmul_trainable: int
    layers: int
    attn_dim: int

    @classmethod
    def of(cls, model) -> ModelShape:
        frozen, trainable = moe.matmul_weights(model, moe.routing(model.config).active_share)
        text = model.config.get_text_config()
        return cls(
            matmul_frozen=frozen,
            matmul_trainable=trainable,
            layers=text.num_hidden_layers,
            attn_dim=round(text.num_attention_heads * mean_head_dim(text)),
        )

    def flops_per_token(self, seq_len: int) -> int:
        return training_flops_per_token(
            self.matmul_frozen, self.matmul_trainable, self.layers, seq_len, self.attn_dim
        )


def mean_head_dim(text) -> float:
    """The attention head width, averaged over the layers (Gemma-4's full-attention layers are wider than
    its sliding ones)."""
    fallback = text.hidden_size // text.num_attention_heads
    widths = [getattr(c, "head_dim", None) or fallback for c in layer_configs(text, text.num_hidden_layers)]
    return sum(widths) / len(widths)


def device_name(device: torch.device) -> str | None:
    """The name `peak_flops` looks up: the CUDA device's, None elsewhere."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None
