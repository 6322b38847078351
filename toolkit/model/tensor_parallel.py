"""Tensor parallelism for Llama, Qwen2 and Mistral-shaped models: each decoder layer's linear weights split
across the tensor-parallel ranks (q/k/v/gate/up by output rows, o/down by input columns, so a layer costs
one all-reduce after attention and one after the MLP), the rest replicated on every rank.

Which layers split comes from the model's own transformers plan (`config.base_model_tp_plan`); ftkit applies
it with torch's `parallelize_module` on the launch's device mesh, after LoRA is added, splitting each adapter
with its layer (lora_B with a column split, lora_A with a row split) so adapters train on every model layer
transformers splits. Embeddings and the output head stay whole: the chunked loss head scores the whole
vocabulary on every rank, and TP ranks hold the same batch, so their replicated weights stay identical.
"""

from __future__ import annotations

import re

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

SPLIT_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
# The adapter piece that splits with its layer: the one whose weight shares the layer's split dimension.
ADAPTER_PIECE = {"colwise": "lora_B", "rowwise": "lora_A"}
DIVIDED = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def plan_problem(config, tp: int) -> str | None:
    """Why the model built from `config` cannot be split `tp` ways (one phrase), or None."""
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        return (
            f"model type {config.model_type} has no tensor-parallel plan in transformers: tensor parallelism "
            "trains Llama, Qwen2 and Mistral-shaped models; use ddp, fsdp or zero3 for this one"
        )
    others = sorted(set(plan.values()) - set(SPLIT_STYLES))
    if others:
        return (
            f"model type {config.model_type} splits layers as {', '.join(others)}, which ftkit's tensor "
            "parallelism does not apply (it splits colwise and rowwise layers): use fsdp or zero3"
        )
    for key in DIVIDED:
        value = getattr(config, key, None)
        if value and value % tp:
            return f"{key} {value} is not divisible by the tensor-parallel size {tp}"
    return None


def method_problem(method: str, use_dora: bool) -> str | None:
    """The config key and reason a fine-tuning method cannot run split, or None."""
    if method == "qlora":
        return (
            "model.method qlora (4-bit packed weights cannot be split across ranks): use fsdp.yaml or "
            "zero3.yaml"
        )
    if use_dora and method != "full":
        return "lora.use_dora (DoRA rescales each whole weight by its norm): use plain LoRA or full"
    return None


def parallelize(model, mesh, config):
    """Split `model` (plain or with LoRA adapters) across the 1-D `mesh` per `config`'s plan, in place."""
    styles = split_styles(model, config.base_model_tp_plan)
    parallelize_module(model, mesh, {name: SPLIT_STYLES[style]() for name, style in styles.items()})
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base._tp_size = mesh.size()  # what accelerate reads to accept a model split before `prepare`
    return model


def split_styles(model, plan: dict[str, str]) -> dict[str, str]:
    """Full module name -> colwise | rowwise for every linear layer (and adapter piece) that splits; the
    plan's other styles (an MoE's packed experts, say) are left out."""
    patterns = [
        (re.compile(r"(^|\.)" + re.escape(key).replace(r"\*", r"\d+") + "$"), s) for key, s in plan.items()
    ]
    styles = {}
    for name, module in model.named_modules():
        style = next((s for pattern, s in patterns if pattern.search(name)), None)
        if style not in SPLIT_STYLES:  # none, or a style ftkit does not apply (`plan_problem` refuses those)
            continue
        if not hasattr(module, "base_layer"):
            styles[name] = style
            continue
        styles[f"{name}.base_layer"] = style
        for adapter in getattr(module, ADAPTER_PIECE[style]):
            styles[f"{name}.{ADAPTER_PIECE[style]}.{adapter}"] = style
    return styles
