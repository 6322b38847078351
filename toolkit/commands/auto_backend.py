"""`ftkit train --backend auto`: ask the estimator behind `ftkit plan` what fits this machine.

With GPUs it plans for their count and memory. Without, it plans the dry run: the gloo processes
share the CPU RAM, so each process gets its share as its "device" memory.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from toolkit.config import RecipeConfig
from toolkit.errors import UserError
from toolkit.grpo.config import GrpoRecipeConfig
from toolkit.plan.estimate import make_plan
from toolkit.plan.memory import GIB
from toolkit.plan.request import VISION_KEYS, PlanRequest
from toolkit.preference.config import PreferenceConfig

REPO = Path(__file__).resolve().parent.parent.parent


def choose(cfg: RecipeConfig, overrides: list[str], hardware, processes: int) -> tuple[str, list[str], str]:
    """(accelerate config name, recipe overrides it implies, one line saying why)."""
    mem = hardware.gpu_mem_gib if hardware.gpu_count else hardware.ram_gib / processes
    request = plan_request(cfg, overrides, processes, mem)
    if not hardware.gpu_count and request.generation == "vllm":
        # A CPU engine takes grpo.vllm.kv_cache_gb of RAM beside the processes, not a share of theirs.
        request = dataclasses.replace(request, engine="own")
    # With GPUs, offloaded states must also fit in RAM; without, RAM is what the processes share already.
    plan = make_plan(dataclasses.replace(request, cpu_mem=hardware.ram_gib if hardware.gpu_count else None))
    row = plan.choice
    device = "GPU" if hardware.gpu_count else "process (no GPU: a share of CPU RAM)"
    if row is None:
        smallest = min(plan.rows, key=lambda r: r.per_gpu()["total"])
        need = smallest.per_gpu()["total"] / GIB
        raise UserError(
            f"auto: nothing fits {processes} x {mem:g} GiB per {device} and {hardware.ram_gib:g} GiB RAM; "
            "the smallest setup, "
            f"{smallest.backend} with gradient checkpointing {_on(smallest.checkpointing)}, needs "
            f"{need:.1f} GiB per GPU and {smallest.cpu_ram / GIB:.1f} GiB RAM: use a machine that large, "
            "or model.method=lora/qlora, a shorter data.max_length"
        )
    extra = [f"train.micro_batch_size={row.micro_batch}"]
    extra += [f"model.gradient_checkpointing={str(row.checkpointing).lower()}"]
    extra = [item for item in extra if item.split("=")[0] not in _keys(overrides)]
    total = row.per_gpu()["total"] / GIB
    reason = (
        f"auto: {row.backend}: {total:.1f} of {mem:.3g} GiB per {device}, gradient checkpointing "
        f"{_on(row.checkpointing)}, micro-batch {row.micro_batch}"
    )
    return row.backend, extra, reason


def plan_request(cfg: RecipeConfig, overrides: list[str], processes: int, mem_gib: float) -> PlanRequest:
    """The recipe config as the estimator sees it; what the user fixed on the command line stays fixed.
    A preference config plans two sequences per pair, and a separate reference model's weights; a GRPO
    config its generation round too; a vision-language model's the parts its vision section trains."""
    fixed = _keys(overrides)
    dpo = cfg.dpo if isinstance(cfg, PreferenceConfig) else None
    ckpt = cfg.model.gradient_checkpointing
    model = Path(cfg.model.path)
    request = PlanRequest(
        model=str(REPO / model) if not model.exists() and (REPO / model).exists() else cfg.model.path,
        gpus=processes,
        gpu_mem=mem_gib,
        method=cfg.model.method,
        seq_len=cfg.data.max_length,
        micro_batch=cfg.train.micro_batch_size if "train.micro_batch_size" in fixed else None,
        global_batch=cfg.train.global_batch_size,
        lora_r=cfg.lora.r,
        lora_dropout=cfg.lora.dropout,
        grad_ckpt=_on(ckpt) if "model.gradient_checkpointing" in fixed and ckpt != "auto" else "auto",
        dtype=cfg.model.dtype if cfg.model.dtype in ("float32", "bfloat16") else "auto",
        mixed_precision="no" if cfg.train.mixed_precision == "no" else "bf16",
        objective="dpo" if dpo else "sft",
        reference_model=bool(dpo and dpo.reference_model),
        loss_head=cfg.loss.head,
        chunk_tokens=cfg.loss.chunk_tokens,
        packing=cfg.data.packing or cfg.data.streaming,
        **{key: getattr(cfg.vision, key) for key in VISION_KEYS},
    )
    return _with_grpo(request, cfg) if isinstance(cfg, GrpoRecipeConfig) else request


def _with_grpo(request: PlanRequest, cfg: GrpoRecipeConfig) -> PlanRequest:
    grpo = cfg.grpo
    return dataclasses.replace(
        request,
        objective="grpo",
        # With grpo.beta 0 the recipe loads no reference, whatever grpo.reference_model says.
        reference_model=bool(grpo.reference_model) and grpo.beta > 0,
        generations=grpo.num_generations,
        max_new_tokens=grpo.max_new_tokens,
        generation_batch=grpo.generation_batch_size,
        steps_per_generation=grpo.steps_per_generation,
        gather_for_generation=grpo.gather_for_generation,
        beta=grpo.beta,
        generation=grpo.generation,
        gpu_memory_utilization=grpo.vllm.gpu_memory_utilization,
        engine="own" if grpo.vllm.url or grpo.vllm.gpus else "shared",
        replicas=grpo.vllm.replicas,
    )


def _keys(overrides: list[str]) -> set[str]:
    return {item.split("=", 1)[0] for item in overrides}


def _on(flag) -> str:
    return "on" if flag is True else "off"
