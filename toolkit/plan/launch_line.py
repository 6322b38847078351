"""The `accelerate launch` line a plan recommends: the shipped recipe config closest to the planned run, plus
the overrides the plan assumed."""

from __future__ import annotations

import shlex
from pathlib import Path

from toolkit.model import vision
from toolkit.plan import architectures
from toolkit.plan.footprint import MemoryEstimate
from toolkit.plan.memory import Precision
from toolkit.plan.request import VISION_KEYS, PlanRequest
from toolkit.recipes import SCRIPTS, load_any_recipe_config, recipe_name
from toolkit.typed_yaml import dotted, to_dict

# The printed command runs from a checkout's root, so its recipe configs are looked up from there too.
RECIPE_CONFIGS = Path("recipes") / "configs"


def launch_line(
    row: MemoryEstimate, request: PlanRequest, precision: Precision, seeing: bool = False
) -> str | None:
    """The exact `accelerate launch` line: a shipped recipe config plus the overrides this plan assumed
    (`seeing`: for a vision-language model, from a vision-language model's config)."""
    template = _template_config(request.model, request.method, request.objective, seeing)
    if template is None:
        return None
    path, current = template
    model_path = Path(request.model).parent if request.model.endswith(".json") else request.model
    wanted = {
        "model.path": str(model_path),
        "model.method": request.method,
        "model.dtype": precision.weights,
        "model.gradient_checkpointing": row.checkpointing,
        "train.mixed_precision": precision.mixed,
        "data.max_length": request.seq_len,
        "train.global_batch_size": request.global_batch,
        "loss.head": request.loss_head,
        "loss.chunk_tokens": request.chunk_tokens,
    }
    if str(model_path) != current["model.path"]:
        wanted["model.adapter"] = None  # the template's adapter was trained on the template's model
    if request.method != "full":
        wanted |= {
            "lora.r": request.lora_r,
            "lora.dropout": request.lora_dropout,
            "lora.target_modules": "all-linear",
        }
    if request.packing:  # the recipe takes one of the two
        wanted |= {"data.packing": True, "data.group_by_length": False}
    if seeing:
        wanted |= {f"vision.{key}": getattr(request, key) for key in VISION_KEYS}
    if request.objective == "embed":
        wanted |= {"embed.task": request.embed_task, "embed.cached": request.cached}
    if request.objective == "grpo":
        wanted |= {
            "grpo.num_generations": request.generations,
            "grpo.max_new_tokens": request.max_new_tokens,
            "grpo.generation_batch_size": request.generation_batch,
            "grpo.steps_per_generation": request.steps_per_generation,
            "grpo.gather_for_generation": request.gather_for_generation,
            "grpo.beta": request.beta,
            "grpo.generation": request.generation,
        }
        if request.generation == "vllm":
            wanted["grpo.vllm.gpu_memory_utilization"] = request.gpu_memory_utilization
        if request.generation == "vllm" and request.replicas > 1:
            wanted["grpo.vllm.replicas"] = request.replicas
            first = request.gpus  # after the training GPUs
            wanted["grpo.vllm.gpus"] = ",".join(str(first + i) for i in range(request.replicas))
        elif request.generation == "vllm" and request.engine == "own":
            wanted["grpo.vllm.url"] = "http://ENGINE_HOST:PORT"  # yours: the plan cannot know its address
    overrides = [f"{key}={_yaml_value(value)}" for key, value in wanted.items() if current[key] != value]
    overrides.append(f"train.micro_batch_size={row.micro_batch}")
    procs = "" if row.backend == "single" else f" --num_processes {request.gpus}"
    return (
        f"accelerate launch --config_file accelerate_configs/{row.backend}.yaml{procs} "
        f"{SCRIPTS[request.objective]} --config {path} " + " ".join(shlex.quote(item) for item in overrides)
    )


def _template_config(model: str, method: str, objective: str, seeing: bool) -> tuple[str, dict] | None:
    """The shipped recipe config closest to this run: among the configs of the objective's recipe (as their
    sections tell) for a model that sees images when this one does (their data holds images), same method
    first, then same model, then same shapes."""
    loaded = {path: load_any_recipe_config(path) for path in sorted(RECIPE_CONFIGS.glob("*.yaml"))}
    configs = {
        path: cfg
        for path, cfg in loaded.items()
        if recipe_name(cfg) == objective and _sees(cfg.model.path) == seeing
    }
    if not configs:
        return None
    arch = architectures.lookup(model)

    def closeness(path: Path):
        cfg = configs[path]
        same_arch = arch is not None and architectures.lookup(cfg.model.path) == arch
        return (
            cfg.model.method == method,
            cfg.model.path.lower() == model.lower(),
            same_arch,
            not path.name.startswith("demo"),  # a real model's config over an embedded demo's
            not _specialised(cfg),  # plain GRPO over distillation or a tool environment
        )

    best = max(configs, key=closeness)
    return str(best), dotted(to_dict(configs[best]))


def _specialised(cfg) -> bool:
    """Whether a GRPO config trains something other than plain GRPO (a teacher, an environment)."""
    grpo = getattr(cfg, "grpo", None)
    if grpo is None:
        return False
    openenv = grpo.environment.openenv
    return bool(grpo.teacher or grpo.environment.tools or openenv.url or openenv.app)


def _sees(model: str) -> bool:
    """Whether a recipe config's model (built in, or a local folder) is a vision-language model."""
    built_in = architectures.lookup(model)
    kind = built_in["model_type"] if built_in else vision.model_type(model, download=False)
    return vision.is_vision(kind)


def _yaml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)
