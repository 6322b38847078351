"""What LoRA adapts on a mixture of experts, the same on every family: the recipe's `lora.target_modules`
picks linear layers, and `lora.experts`, `router`, `shared_expert` and `attention` pick the parts.

peft alone gives each family something else for "all-linear": on Qwen3-MoE, OLMoE and Mixtral its
conversion for transformers v5 adds the routed experts and the router (names of their former linear
layers), on Qwen2-MoE and gpt-oss neither. So ftkit names peft's targets itself: linear layers by name,
the fused experts and the routers' weights as parameters. A linear layer whose name peft would convert
(a dense or shared expert MLP's `gate_proj` on a Qwen3-MoE-like family) is named as a parameter too, which
peft does not convert, so its adapter stays on that layer. A dense model gets `target_modules` as written.
"""

from __future__ import annotations

import re

import torch

from toolkit.config import LoraConfig
from toolkit.model import moe

# Names of the experts' and router's former linear layers, which peft's conversion maps onto fused tensors
# (used when peft's own table cannot be read).
CONVERTED_NAMES = frozenset({"gate", "w1", "w2", "w3", "gate_proj", "up_proj", "down_proj"})
FUSED_GATE_UP = "gate_up_proj"
"""Fused gate and up projections: two layers in one tensor, so their adapter gets twice the rank and alpha
(each half keeps rank r and the scale alpha / r), as peft gives it."""


def peft_targets(lora: LoraConfig, model) -> dict:
    """peft LoraConfig keywords naming what `lora` adapts on `model`: target_modules, and for a mixture of
    experts target_parameters and the fused gate/up tensor's rank and alpha."""
    if not moe.routing(model.config).experts:
        return {"target_modules": lora.target_modules}
    converted = _converted_by_peft(model.config.model_type)
    named, linears = _linear_names(model, lora.target_modules)
    wanted = [name for name in named if _wanted(lora, moe.part_of(name))]
    modules = [name for name in wanted if name.rpartition(".")[2] not in converted]
    parameters = [f"{name}.weight" for name in wanted if name.rpartition(".")[2] in converted]
    if lora.experts:
        parameters += moe.expert_parameter_names(model) or []
    if lora.router:
        parameters += _router_weights(model)
    kwargs = {"target_modules": _short_names(modules, linears), "target_parameters": parameters or None}
    if lora.experts and any(name.endswith(FUSED_GATE_UP) for name in parameters):
        pattern = rf".*\.{FUSED_GATE_UP}"
        kwargs.update(rank_pattern={pattern: 2 * lora.r}, alpha_pattern={pattern: 2 * lora.alpha})
    return kwargs


def _wanted(lora: LoraConfig, part: str) -> bool:
    return {"attention": lora.attention, "shared expert": lora.shared_expert, "experts": lora.experts}.get(
        part, part != "router"
    )


def _linear_names(model, target_modules: str | list[str]) -> tuple[list[str], list[str]]:
    """(the linear layers `target_modules` names, every linear layer but the output head), by peft's rules:
    "all-linear" (all of them), a list of names (a layer's whole name or its last parts) or one regular
    expression (whole name)."""
    head = model.get_output_embeddings()
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    ]
    if target_modules == "all-linear":
        return names, names
    if isinstance(target_modules, str):
        return [name for name in names if re.fullmatch(target_modules, name)], names
    return [name for name in names if any(name == t or name.endswith(f".{t}") for t in target_modules)], names


def _router_weights(model) -> list[str]:
    """The routers' weights, as peft names parameters (`mlp.gate.weight`; `mlp.router.weight` on gpt-oss)."""
    names = {
        moe.in_layer(name)
        for name, _ in model.named_parameters()
        if name.endswith(".weight") and moe.part_of(name) == "router"
    }
    return sorted(names)


def _short_names(modules: list[str], linears: list[str]) -> list[str]:
    """`modules` as the shortest names peft matches: a last name (`q_proj`) where every one of `linears`
    with that name is chosen, the whole name otherwise, so the adapter's config stays readable."""
    chosen = set(modules)
    by_leaf: dict[str, list[str]] = {}
    for name in linears:
        by_leaf.setdefault(name.rpartition(".")[2], []).append(name)
    short = set()
    for name in modules:
        leaf = name.rpartition(".")[2]
        short.add(leaf if all(other in chosen for other in by_leaf[leaf]) else name)
    return sorted(short)


def _converted_by_peft(model_type: str) -> frozenset[str]:
    """Layer names peft's v4-to-v5 conversion maps onto fused tensors for `model_type` (its table is
    private: when it cannot be read, the names it has used)."""
    try:
        from peft.utils import transformers_weight_conversion as conversion

        family = conversion._MODEL_TO_CONVERSION_PATTERN.get(model_type)
        return frozenset(conversion._MOE_TARGET_MODULE_MAPPING.get(family, {}))
    except (ImportError, AttributeError):
        return CONVERTED_NAMES
