"""Expert parallelism: a mixture of experts' routed experts split across the processes, everything else
replicated as under DDP. Built on transformers' own expert-parallel plan (the config's
`base_model_ep_plan`): each fused experts tensor becomes a DTensor holding this process's experts, and
each MoE layer sends its tokens to the process holding their experts and back with all-to-all.

Each process trains its own micro-batch, so the replicated weights' gradients are averaged by DDP (the
split ones are left out of it) and the split ones' gradients, which the all-to-all's backward sums over
every process's tokens, are divided by the process count: both are then the gradient of the mean loss,
as one process on the union of the micro-batches computes it."""

from __future__ import annotations

import re

from torch.distributed.tensor import DTensor


def has_plan(model_type: str) -> bool:
    """Whether transformers ships an expert-parallel plan for `model_type` (unknown types: no)."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:  # a lazy mapping whose get() knows no model type
        return False
    return bool(getattr(CONFIG_MAPPING[model_type], "base_model_ep_plan", None))


def ep_plan(model) -> dict[str, str]:
    """The model's expert-parallel plan with its `*` replaced by every layer number (transformers' styles
    by module or parameter name)."""
    prefix = f"{model.base_model_prefix}." if model.base_model_prefix else ""
    rules = {
        re.compile(re.escape(prefix + rule).replace(r"\*", r"\d+") + "$"): style
        for rule, style in (model.config.get_text_config().base_model_ep_plan or {}).items()
    }
    names = [name for name, _ in model.named_parameters()] + [name for name, _ in model.named_modules()]
    return {name: style for name in names for rule, style in rules.items() if rule.match(name)}


def split_experts(model, processes: int) -> None:
    """Split `model`'s routed experts over `processes` (all of this launch's), in place; call it before
    any adapter is added (the plan names the bare model's modules)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    device = next(model.parameters()).device.type
    mesh = init_device_mesh(device, (processes, 1), mesh_dim_names=("ep", "tp"))
    # A tensor-parallel size of 1: no two processes share a micro-batch.
    apply_expert_parallelism(model, mesh["ep"], mesh["tp"], ep_plan(model), ep_implementation="all_to_all")


def split_names(model) -> list[str]:
    """Names of `model`'s parameters split across processes."""
    return [name for name, param in model.named_parameters() if isinstance(param, DTensor)]


def keep_out_of_ddp(model, processes: int) -> None:
    """Leave the split parameters out of DDP's broadcast and averaging (each process holds other experts)
    and divide their gradients by `processes` as they are computed."""
    from torch.nn.parallel import DistributedDataParallel

    names = split_names(model)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    params = dict(model.named_parameters())
    for name in names:
        if params[name].requires_grad:  # frozen under LoRA
            params[name].register_hook(lambda grad: grad / processes)


def split_size(model) -> int:
    """Processes `model`'s experts are split over (1: none; a model under FSDP or TP holds DTensors on
    other meshes)."""
    for param in model.parameters() if model is not None else ():
        if isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == ("ep",):
            return param.device_mesh.size()
    return 1
