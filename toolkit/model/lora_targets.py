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
from toolkit.errors import UserError
from toolkit.model import moe

# Names of the experts' and router's former linear layers, which peft's conversion maps onto fused tensors
# (used when peft's own table cannot be read).
CONVERTED_NAMES = frozenset({"gate", "w1", "w2", "w3", "gate_proj", "up_proj", "down_proj"})
FUSED_GATE_UP = "gate_up_proj"
"""Fused gate and up projections: two layers in one tensor, so their adapter gets twice the rank and alpha
(each half keeps rank r and the scale alpha / r), as peft gives it."""


# Families whose Mamba mixers peft will not adapt by these layer names (its fused kernels read the weights
# directly): peft refuses them by name, so "all-linear" leaves them out here.
MAMBA_FAMILIES = frozenset({"falcon_h1", "falcon_mamba", "mamba", "mamba2", "nemotron_h"})
MAMBA_REFUSED = frozenset({"out_proj", "conv1d"})


def peft_targets(lora: LoraConfig, model) -> dict:
    """peft LoraConfig keywords naming what `lora` adapts on `model`: target_modules, and for a mixture of
    experts target_parameters and the fused gate/up tensor's rank and alpha."""
    if not moe.routing(model.config).experts:
        return {"target_modules": _dense_targets(model, lora.target_modules)}
    converted = _converted_by_peft(model.config.model_type)
    named, linears = _linear_names(model, lora.target_modules)
    wanted = [name for name in named if _wanted(lora, moe.part_of(name))]
    modules = [name for name in wanted if name.rpartition(".")[2] not in converted]
    parameters = [f"{name}.weight" for name in wanted if name.rpartition(".")[2] in converted]
    if lora.experts:
        parameters += moe.expert_parameter_names(model) or []
    if lora.router:
        parameters += _router_weights(model)
    return {"target_modules": _short_names(modules, linears), **parameter_targets(lora, parameters)}


def parameter_targets(lora: LoraConfig, parameters: list[str]) -> dict:
    """peft keywords adapting `parameters` (fused experts, routers' weights) as parameters: the fused gate
    and up tensor gets twice the rank and alpha."""
    kwargs = {"target_parameters": parameters or None}
    if any(name.endswith(FUSED_GATE_UP) for name in parameters):
        pattern = rf".*\.{FUSED_GATE_UP}"
        kwargs.update(rank_pattern={pattern: 2 * lora.r}, alpha_pattern={pattern: 2 * lora.alpha})
    return kwargs


def _wanted(lora: LoraConfig, part: str) -> bool:
    return {"attention": lora.attention, "shared expert": lora.shared_expert, "experts": lora.experts}.get(
        part, part != "router"
    )


def _dense_targets(model, target_modules: str | list[str]) -> str | list[str]:
    """A dense model's target_modules: as written, but "all-linear" spelled out where peft's own reading
    would take a layer it cannot adapt."""
    if target_modules != "all-linear":
        _linear_names(model, target_modules)  # refuses a named layer that cannot be adapted
        return target_modules
    names, linears = _linear_names(model, target_modules)
    head = model.get_output_embeddings()
    every = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    return target_modules if len(names) == len(every) else _short_names(names, linears)


def adaptable(model, name: str, module: torch.nn.Module) -> bool:
    """Whether peft can adapt `module` (a linear layer called `name`) as what it is: a layer whose forward
    is the plain x @ W.T + b (a model's subclass that reshapes its input, as DeepSeek-V4's grouped output
    projection, would get an adapter of the wrong shape; a quantized layer is peft's to handle), and no
    Mamba mixer's layer that peft refuses."""
    if _refused_on_mamba(model, name):
        return False
    cls = type(module)
    return not cls.__module__.startswith("transformers.models.") or cls.forward is torch.nn.Linear.forward


def _refused_on_mamba(model, name: str) -> bool:
    kind = getattr(model.config, "model_type", None)
    return kind in MAMBA_FAMILIES and name.rpartition(".")[2] in MAMBA_REFUSED


def _linear_names(model, target_modules: str | list[str]) -> tuple[list[str], list[str]]:
    """(the linear layers `target_modules` names, every linear layer but the output head that peft can
    adapt), by peft's rules: "all-linear" (all of them), a list of names (a layer's whole name or its last
    parts) or one regular expression (whole name). A layer named explicitly that cannot be adapted is
    refused in one line."""
    head = model.get_output_embeddings()
    linears = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    ]
    names = [name for name, module in linears if adaptable(model, name, module)]
    if target_modules == "all-linear":
        return names, names
    blocked = [name for name, module in linears if name not in names and _named(name, target_modules)]
    if blocked:
        raise UserError(
            f"lora.target_modules: {target_modules}: {blocked[0]} cannot carry a LoRA adapter on "
            f"{model.config.model_type} ({_why_not(model, blocked[0])}); name other layers or use all-linear"
        )
    return [name for name in names if _named(name, target_modules)], names


def _named(name: str, target_modules: str | list[str]) -> bool:
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith(f".{t}") for t in target_modules)


def _why_not(model, name: str) -> str:
    if _refused_on_mamba(model, name):
        return "peft does not adapt a Mamba mixer's out_proj or conv1d"
    return f"{type(model.get_submodule(name)).__name__} is not used as a plain linear layer"


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
