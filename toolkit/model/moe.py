"""What ftkit knows of a mixture of experts: how many routed experts a layer has, how many each token goes
to, how wide each expert is, and which tensors are the routed experts. Transformers stores a layer's routed
experts fused, as 3-D tensors [experts, out, in] (`mlp.experts.gate_up_proj`, `down_proj`): every token
multiplies by `experts_per_token / experts` of them, and bitsandbytes, which quantizes `nn.Linear` only,
leaves them unquantized."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit.model import quant

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
PER_TOKEN_KEYS = ("num_experts_per_tok", "experts_per_token")
SHARED_WIDTH_KEYS = ("shared_expert_intermediate_size", "shared_intermediate_size")


@dataclass(frozen=True)
class Routing:
    experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""
    per_token: int = 0
    """Experts each token is sent to."""
    expert_width: int = 0
    """Inner width of one routed expert's MLP."""
    shared_width: int = 0
    """Inner width of the shared expert every token also goes through (0: none)."""

    @property
    def active_share(self) -> float:
        """The share of the routed experts' weights one token multiplies by (1 for a dense model)."""
        return self.per_token / self.experts if self.experts else 1.0

    @property
    def active_width(self) -> int:
        """The MLP width one token's activations span: its experts' and the shared expert's."""
        return self.per_token * self.expert_width + self.shared_width


def routing(config) -> Routing:
    """The routing of a transformers config (a dense model's is all zeros)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = max((int(getattr(text, key, None) or 0) for key in EXPERT_KEYS), default=0)
    if experts < 2:
        return Routing()
    per_token = next((int(getattr(text, k)) for k in PER_TOKEN_KEYS if getattr(text, k, None)), 1)
    width = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
    shared = next((getattr(text, k) for k in SHARED_WIDTH_KEYS if getattr(text, k, None)), 0)
    return Routing(experts, per_token, width, int(shared))


PARTS = (
    ("shared expert", (".shared_expert", ".shared_mlp.")),
    ("experts", (".experts.",)),
    ("router", (".gate.", ".router.")),
    ("attention", (".self_attn.",)),
)


def part_of(name: str) -> str:
    """The part of a mixture of experts a parameter or module name belongs to: the routed experts, the
    shared expert (Qwen2-MoE's `shared_expert`, Granite's `shared_mlp`), the router, attention, or other
    (embeddings, norms, the head, a dense layer's MLP)."""
    return next((part for part, keys in PARTS if any(key in f"{name}." for key in keys)), "other")


def trained_parts(model) -> dict[str, int]:
    """Trainable parameters of a mixture of experts by part (see part_of), the parts with none left out."""
    counts: dict[str, int] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            part = part_of(name)
            counts[part] = counts.get(part, 0) + getattr(param, "ds_numel", param.numel())
    return counts


def expert_parameter_names(model) -> list[str] | None:
    """The routed experts' fused tensors as peft names parameter targets (`mlp.experts.gate_up_proj`, ...),
    or None for a dense model."""
    names = {
        in_layer(unpacked_name(f"{owner}.{name}"))
        for owner, module in model.named_modules()
        for name, param in module.named_parameters(recurse=False)
        if is_routed_expert(param, module)
    }
    return sorted(names) or None


def in_layer(name: str) -> str:
    """A parameter's name inside its decoder layer (`mlp.experts.gate_up_proj`), as peft names parameter
    targets so one name reaches every layer."""
    return name.split(".layers.")[-1].split(".", 1)[-1]


def expert_modules(config, trust_remote_code: bool = False) -> list[str]:
    """Names of the modules holding a model's fused routed experts (none for a dense model), read from the
    model built on the meta device."""
    if not routing(config).experts:
        return []
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return [
        name
        for name, module in model.named_modules()
        if any(is_routed_expert(p, module) for p in module.parameters(recurse=False))
    ]


def unpacked_name(name: str) -> str:
    """A parameter's name as the model's code reads it: `experts.gate_up_proj` for a 4-bit one's stored
    `experts.parametrizations.gate_up_proj.original` (see quant_experts)."""
    if not quant.is_packed_experts(name):
        return name
    return name.replace(".parametrizations.", ".").removesuffix(f".{quant.PACKED_EXPERTS}")


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The whole tensor's shape: under ZeRO-3's partitioning (it keeps the original in `ds_shape`), for
    4-bit experts (quant_experts keeps the unpacked shape in `expert_shape`) and for bitsandbytes' 4-bit
    linear weights (their `quant_state` keeps it) too."""
    packed = getattr(getattr(param, "quant_state", None), "shape", None)
    shape = getattr(param, "expert_shape", None) or packed or getattr(param, "ds_shape", None)
    return tuple(shape or param.shape)


def is_routed_expert(param: torch.Tensor, module: torch.nn.Module) -> bool:
    """Whether `param` of `module` is a fused routed-experts tensor: the model's 3-D weights other than a
    convolution's (Mamba and short-convolution layers keep theirs 3-D)."""
    return len(full_shape(param)) == 3 and not isinstance(module, torch.nn.modules.conv._ConvNd)


def matmul_weights(model, share: float) -> tuple[int, int]:
    """(frozen, trainable) weights one token multiplies by: every linear layer's, a router's (a 2-D weight
    outside linear layers and embeddings), and `share` of the fused routed experts'."""
    frozen = trainable = 0.0
    for module in model.modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.modules.conv._ConvNd)):
            continue
        for name, param in module.named_parameters(recurse=False):
            shape = full_shape(param)
            if len(shape) == 3:
                numel = share * _numel(shape)
            elif len(shape) == 2 and (isinstance(module, torch.nn.Linear) or name == "weight"):
                numel = _numel(shape)
            else:
                continue
            frozen, trainable = (
                (frozen, trainable + numel) if param.requires_grad else (frozen + numel, trainable)
            )
    return round(frozen), round(trainable)


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total
