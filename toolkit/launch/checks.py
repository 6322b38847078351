"""Check a launch (an accelerate YAML, or the environment accelerate launch set) against the recipe config.

`ftkit check-config` runs these checks on a YAML before anything starts; the recipe runs them at launch on
`backend.detect_launch()`. Conflicts raise `UserError`; what needs no action comes back as notes.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from pathlib import Path

from toolkit.config import ModelConfig, RecipeConfig, TrainConfig
from toolkit.errors import UserError
from toolkit.evaluation import training
from toolkit.launch.backend import (
    as_tensor_parallel,
    deepspeed_launch,
    refuse_unsupported,
    sequence_parallel_attention,
)
from toolkit.launch.deepspeed import DS_SETTINGS_ENV
from toolkit.launch.machine import GEFORCE_40, Machine
from toolkit.launch.mesh import check_mesh
from toolkit.launch.op_builds import refuse_left_locks
from toolkit.launch.request import Launch, backend_name
from toolkit.launch.rows import check_rows
from toolkit.launch.sections import (
    PARALLEL_SIZES,
    gather_setting,
    refuse_deepspeed_sections,
    refuse_fsdp_settings,
    refuse_parallelism,
    refuse_unknown_wrap_classes,
)
from toolkit.model import expert_parallel, families, quant, tensor_parallel, vision
from toolkit.model.facts import ModelFacts
from toolkit.pipeline import stages
from toolkit.train import head
from toolkit.train.batches import grad_accum_steps
from toolkit.typed_yaml import Sources, dotted, read_yaml_mapping

# What each accelerate distributed_type starts, in ftkit's words. Others are refused: MULTI_CPU starts one
# process, and the rest are other hardware or Megatron-LM.
BACKEND_OF_TYPE = {"NO": "single", "MULTI_GPU": "ddp", "FSDP": "fsdp", "DEEPSPEED": "deepspeed"}
NCCL_P2P_VARS = ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE")


def launch_from_yaml(path: Path, gpu_count: int, num_processes: int | None = None) -> Launch:
    """What `accelerate launch --config_file path [--num_processes N]` starts where `gpu_count` GPUs exist."""
    raw = read_yaml_mapping(path, "accelerate config")
    dtype = raw.get("distributed_type")
    if dtype is False:
        raise UserError(f"{path}: distributed_type must be quoted as 'NO' (YAML reads a bare NO as false)")
    backend = BACKEND_OF_TYPE.get(str(dtype).upper())
    if backend is None:
        raise UserError(
            f"{path}: distributed_type {dtype} is not supported: use one of {', '.join(BACKEND_OF_TYPE)} "
            "(without GPUs, MULTI_GPU runs on gloo CPU processes)"
        )
    _refuse_ignored_offload(raw, backend, path)
    world = 1 if backend == "single" else num_processes or raw.get("num_processes")
    if not isinstance(world, int) or world < 1:
        raise UserError(f"{path}: num_processes is missing, pass --num-processes as to accelerate launch")
    common = dict(
        world_size=world,
        procs_per_node=world // int(raw.get("num_machines", 1)),
        on_cpu=gpu_count == 0,
        source=str(path),
        launcher_precision=str(raw.get("mixed_precision") or ""),
        parallel_sizes=_yaml_parallel_sizes(raw.get("parallelism_config") or {}),
    )
    if backend == "deepspeed":
        section = raw.get("deepspeed_config") or {}
        settings = {key: str(section[key]).lower() for key in DS_SETTINGS_ENV.values() if key in section}
        return deepspeed_launch(section.get("deepspeed_config_file", ""), settings, **common)
    if backend == "fsdp":
        fsdp = raw.get("fsdp_config") or {}
        settings = {key.removeprefix("fsdp_"): str(value) for key, value in fsdp.items()}
        launch = Launch(
            "fsdp", fsdp_version=int(fsdp.get("fsdp_version", 1)), fsdp_settings=settings, **common
        )
        return as_tensor_parallel(launch)
    return as_tensor_parallel(Launch(backend, **common))


def _yaml_parallel_sizes(section: dict) -> dict[str, int]:
    keys = {name: f"parallelism_config_{name}_size" for name in PARALLEL_SIZES}
    return {name: int(section[key]) for name, key in keys.items() if key in section}


def _refuse_ignored_offload(raw: dict, backend: str, path: Path) -> None:
    """Offload settings in another backend's section are silently dropped by accelerate."""
    ds_offload = {
        k: v
        for k, v in (raw.get("deepspeed_config") or {}).items()
        if k.startswith("offload_") and str(v).lower() != "none"
    }
    if backend != "deepspeed" and ds_offload:
        raise UserError(
            f"{path}: {', '.join(ds_offload)} in deepspeed_config is ignored by {backend}: remove it"
        )
    if backend != "fsdp" and (raw.get("fsdp_config") or {}).get("fsdp_offload_params"):
        raise UserError(f"{path}: fsdp_offload_params in fsdp_config is ignored by {backend}: remove it")


def check_launch(
    launch: Launch,
    cfg: RecipeConfig,
    facts: ModelFacts,
    recipe_source: str | Sources,
    machine: Machine,
    env: MutableMapping[str, str],
) -> list[str]:
    """Raise UserError where the launch, the recipe config and the model (`facts`, its config read once)
    disagree; set in `cfg` what the launch needs and ftkit can choose without changing the math; return
    notes worth logging once.

    On RTX 40xx GPUs without peer-to-peer access this sets NCCL_P2P_DISABLE and NCCL_IB_DISABLE in `env`,
    which must happen before the Accelerator starts NCCL (accelerate only does so for drivers before 550).
    """
    recipe_source = recipe_source if isinstance(recipe_source, Sources) else Sources(recipe_source)
    refuse_unsupported(launch)
    ga = grad_accum_steps(cfg.train, launch.mesh.data_parallel)
    refuse_parallelism(launch.parallel_sizes, launch.source)
    _check_vision(launch, cfg, facts, recipe_source)
    check_rows(cfg, launch.mesh.sp, facts, recipe_source, launch.source)
    training.check_benchmarks(cfg, launch.backend, launch.uses_mesh, recipe_source)
    if launch.parallel_sizes:
        check_mesh(launch.mesh, launch.world_size, launch.fsdp_version, launch.backend, launch.source)
    if launch.mesh.tp > 1:
        _check_tensor_parallel(launch.mesh.tp, cfg, facts, recipe_source)
    if launch.mesh.pp > 1:
        _check_pipeline(cfg, facts, ga, recipe_source)
    sp_notes = _check_sequence_parallel(launch, cfg, facts, recipe_source, env) if launch.mesh.sp > 1 else []
    _check_precision(launch, cfg.train, recipe_source, machine)
    if launch.backend == "fsdp":
        refuse_fsdp_settings(launch.fsdp_settings, launch.on_cpu, launch.source)
        wrap = launch.fsdp_settings.get("transformer_layer_cls_to_wrap", "")
        refuse_unknown_wrap_classes(wrap, facts.module_classes, cfg.model.path, launch.source)
    if launch.backend == "deepspeed":
        _check_deepspeed(launch, cfg.train, recipe_source, ga)
    if machine.gpu_count and launch.procs_per_node > machine.gpu_count:
        raise UserError(
            f"{launch.source} starts {launch.procs_per_node} processes per machine but {machine.gpu_count} "
            f"GPU(s) are visible: pass --num_processes {machine.gpu_count} (or fewer)"
        )
    if cfg.model.method == "qlora":
        _check_qlora(launch, cfg.model, facts, cfg.train.mixed_precision, recipe_source)
    if cfg.loss.head == "chunked":
        head.check_loss_head(facts, recipe_source)
    set_keys = {"router_aux_loss_coef": cfg.moe.router_aux_loss_coef is not None}
    set_keys["expert_parallel"] = cfg.moe.expert_parallel > 1
    set_keys["experts_implementation"] = cfg.moe.experts_implementation != "auto"
    moe_keys = [key for key, on in set_keys.items() if on]
    if moe_keys and facts.raw is not None and not facts.experts:
        raise UserError(
            f"moe.{moe_keys[0]} {recipe_source:moe.{moe_keys[0]}}: {facts.path} ({facts.model_type}) is "
            "not a mixture of experts; remove the moe section"
        )
    if cfg.moe.expert_parallel > 1:
        _check_expert_parallel(launch, cfg, facts, recipe_source)
    notes = [*sp_notes, *families.kernel_notes(facts.family, not launch.on_cpu)]
    notes += families.dropout_notes(facts.raw, launch.world_size)
    notes += _disable_nccl_p2p(machine, env)
    if cfg.train.activation_offload and launch.on_cpu:
        notes.append("train.activation_offload: the model computes in CPU memory already; nothing is moved")
    return notes


def _check_vision(launch: Launch, cfg: RecipeConfig, facts: ModelFacts, recipe_source: Sources) -> None:
    """A vision-language model trains on the data-parallel and sharded layouts; the model-parallel ones
    split the language model's layers or sequence in ways its image inputs do not follow yet."""
    if not vision.is_vision(facts.model_type):
        return
    if hasattr(cfg, "grpo"):
        raise UserError(
            f"{recipe_source.of('model.path')}: the grpo recipe samples text-only prompts; {cfg.model.path} "
            f"is a vision-language model ({facts.model_type}): train it with the SFT or preference recipe"
        )
    split = {"tp": launch.mesh.tp, "pp": launch.mesh.pp, "sp": launch.mesh.sp}
    split["moe.expert_parallel"] = cfg.moe.expert_parallel
    used = [f"{name} {size}" for name, size in split.items() if size > 1]
    if used:
        raise UserError(
            f"{launch.source}: {used[0]} does not train a vision-language model ({facts.model_type}, "
            f"{recipe_source}) yet; use single, ddp, fsdp or zero1/2/3"
        )


def _check_expert_parallel(launch: Launch, cfg: RecipeConfig, facts: ModelFacts, recipe_source: str) -> None:
    """Expert parallelism splits the experts over every launched process of a plain multi-process launch,
    evenly, on a model transformers has an expert-parallel plan for, with full weights or adapters
    outside the experts."""
    size = cfg.moe.expert_parallel
    key = f"moe.expert_parallel {size} {recipe_source:moe.expert_parallel}"
    if launch.backend != "ddp" or launch.parallel_sizes:
        raise UserError(
            f"{key}: it runs on a plain multi-process launch (accelerate_configs/ep.yaml), not under "
            f"{backend_name(launch)} from {launch.source}"
        )
    if launch.world_size != size:
        raise UserError(f"{key}: it splits the experts over every process; {launch.world_size} were launched")
    if facts.experts and facts.experts % size:
        raise UserError(
            f"{key}: {facts.model_type}'s {facts.experts} experts a layer do not split {size} ways"
        )
    if not expert_parallel.has_plan(facts.model_type):
        raise UserError(f"{key}: transformers has no expert-parallel plan for {facts.model_type}")
    if cfg.model.method == "qlora" or (cfg.model.method == "lora" and cfg.lora.experts):
        raise UserError(
            f"{key}: adapters on split experts are not supported ({cfg.model.method} with lora.experts); "
            "train full weights, or LoRA with lora.experts: false (adapters on attention, the shared "
            "expert and, with lora.router, the router)"
        )


def _check_tensor_parallel(tp: int, cfg: RecipeConfig, facts: ModelFacts, recipe_source: str) -> None:
    """A model without a tensor-parallel plan, or whose heads or widths do not split `tp` ways, and the
    methods that cannot be split are refused before any data is prepared."""
    method = tensor_parallel.method_problem(cfg.model.method, cfg.lora.use_dora)
    if method:
        raise UserError(f"{recipe_source.of('model.method')}: tensor parallelism (tp {tp}) refuses {method}")
    problem = tensor_parallel.plan_problem(facts.config, tp) if facts.config is not None else None
    if problem:
        raise UserError(f"model.path {cfg.model.path} {recipe_source:model.path}: {problem}")


def _check_sequence_parallel(
    launch: Launch, cfg: RecipeConfig, facts: ModelFacts, recipe_source: str, env: Mapping[str, str]
) -> list[str]:
    """What Ulysses sequence parallelism cannot run, refused before any data is prepared, naming the key;
    what it needs and ftkit can set without changing the math (a precomputed DPO reference) is set in
    `cfg`, with a note returned."""
    sp, where = launch.mesh.sp, f"{launch.source}: parallelism_config_sp_size {launch.mesh.sp}"
    if hasattr(cfg, "grpo"):
        raise UserError(f"{where} runs the SFT and preference recipes; the grpo recipe is refused")
    notes = []
    if hasattr(cfg, "dpo") and _live_reference(cfg):
        # ftkit's reference never trains (the adapter switched off, or a frozen model), so log-probs computed
        # once before training on whole rows are the ones a live reference would give at every step.
        cfg.dpo.precompute_reference = True
        reference = "dpo.reference_model" if cfg.dpo.reference_model else "the adapter switched off"
        notes.append(
            f"dpo.precompute_reference: on (sp {sp} splits each row over its group, so the reference, "
            f"{reference}, scores whole rows once before training: the same log-probs)"
        )
    attention = sequence_parallel_attention(env)
    refusals = {
        "moe.expert_parallel": cfg.moe.expert_parallel > 1,
        "model.attn_implementation eager (DeepSpeed's Ulysses attention needs sdpa or flash attention)": (
            cfg.model.attn_implementation == "eager"
        ),
        f"model.attn_implementation {cfg.model.attn_implementation} with the launch's sp attention "
        f"{attention} (set both alike)": cfg.model.attn_implementation not in ("eager", attention)
        and not (cfg.model.attn_implementation == "auto" and attention == "sdpa"),
    }
    for what, refused in refusals.items():
        if refused:
            raise UserError(f"{where} refuses {what} in {recipe_source}")
    zero = launch.ds_config.get("zero_optimization") or {}
    if launch.zero_stage == 3 and str(zero.get("reduce_scatter", True)).lower() == "false":
        raise UserError(
            f"{where} refuses zero_optimization.reduce_scatter false in {launch.ds_config_file}: ZeRO-3 then "
            "averages some gradient buckets over the data-parallel processes and others over every process"
        )
    raw = facts.raw or {}
    heads, kv_heads = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    kv_heads = kv_heads or heads
    if heads and (heads % sp or (kv_heads % sp and sp % kv_heads)):
        raise UserError(
            f"{where}: model.path {cfg.model.path} has {heads} attention heads and {kv_heads} key/value "
            f"heads; sequence parallelism needs the heads divisible by {sp} (and the key/value heads "
            f"divisible by it, or dividing it)"
        )
    per_step = cfg.train.micro_batch_size * launch.world_size
    if cfg.train.global_batch_size % per_step:
        raise UserError(
            f"{recipe_source.of('train.global_batch_size')}: train.global_batch_size "
            f"({cfg.train.global_batch_size}) is not divisible by train.micro_batch_size "
            f"({cfg.train.micro_batch_size}) x {launch.world_size} processes: under sequence parallelism "
            "every process reads batches of its own, which its group then shares"
        )
    return notes


def _live_reference(cfg) -> bool:
    """A preference config whose reference log-probs come from forward passes during training."""
    from toolkit.preference.config import precomputes_reference, uses_reference

    return uses_reference(cfg) and not precomputes_reference(cfg)


def _check_pipeline(cfg: RecipeConfig, facts: ModelFacts, ga: int, recipe_source: str) -> None:
    """What a pipeline cannot run, refused before any data is prepared, naming the key."""
    pipe, where = cfg.pipeline, f"{recipe_source.of('pipeline.size')}: pipeline.size {cfg.pipeline.size}"
    refusals = {
        "model.method qlora": cfg.model.method == "qlora",
        "train.mixed_precision fp16 (use bf16)": cfg.train.mixed_precision == "fp16",
        "train.activation_offload (its stages keep their own activations)": cfg.train.activation_offload,
        "dpo.reference_model (a separate reference model)": bool(
            getattr(getattr(cfg, "dpo", None), "reference_model", None)
        ),
    }
    for what, refused in refusals.items():
        if refused:
            raise UserError(f"{where} refuses {what}: use ddp, fsdp or zero3 for it")
    interleaved = pipe.schedule == "interleaved_1f1b"
    if interleaved != (pipe.chunks_per_process > 1):
        raise UserError(
            f"{recipe_source.of('pipeline.schedule')}: pipeline.schedule {pipe.schedule} with "
            f"pipeline.chunks_per_process {pipe.chunks_per_process}: interleaved_1f1b needs 2 or more chunks "
            "per process, the others 1"
        )
    if ga < pipe.size:
        raise UserError(
            f"{recipe_source.of('pipeline.size')}: a pipeline of {pipe.size} processes needs at least "
            f"{pipe.size} micro-batches per step, and train.global_batch_size {cfg.train.global_batch_size} "
            f"/ train.micro_batch_size {cfg.train.micro_batch_size} / replicas gives {ga}: lower "
            "train.micro_batch_size"
        )
    if facts.config is None:
        return
    stage_count = pipe.size * pipe.chunks_per_process
    problem = stages.model_problem(facts.config, stage_count) or stages.layers_problem(
        pipe.layers, stage_count, facts.num_layers
    )
    if problem:
        raise UserError(f"model.path {cfg.model.path} {recipe_source:model.path}: {problem}")


def _check_qlora(
    launch: Launch, model: ModelConfig, facts: ModelFacts, mixed_precision: str, recipe_source: str
) -> None:
    """The 4-bit mistakes that train on without an error, refused before anything loads."""
    name = backend_name(launch)
    if name == "fsdp1":
        raise UserError(
            f"model.method qlora {recipe_source:model.method} under FSDP1 ({launch.source}): "
            f"{quant.fsdp1_problem(launch.fsdp_settings)}; use accelerate_configs/fsdp.yaml (FSDP2)"
        )
    cast = quant.cast_dtype(launch.backend, launch.fsdp_version, mixed_precision)
    problem = quant.storage_problem(quant.storage_name(model.quant_storage, cast), cast, name)
    if problem:
        raise UserError(f"{recipe_source.of('model.quant_storage')}: {problem}")
    if facts.raw is not None:  # a hub id not read here is checked once its config is downloaded
        # A vision-language model quantizes its language model, whose widths its text_config holds.
        problem = quant.width_problem(quant.layer_widths(facts.raw.get("text_config") or facts.raw))
        if problem:
            raise UserError(f"model.path {model.path} {recipe_source:model.path}: {problem} (for QLoRA)")


def _check_precision(launch: Launch, train: TrainConfig, recipe_source: str, machine: Machine) -> None:
    wanted, key = train.mixed_precision, "train.mixed_precision"
    if launch.launcher_precision and launch.ds_config_file:
        raise UserError(
            f"mixed_precision {launch.launcher_precision} in {launch.source}: accelerate refuses it beside "
            f"deepspeed_config_file; remove it (train.mixed_precision {recipe_source:{key}} decides)"
        )
    if launch.launcher_precision and launch.launcher_precision != wanted:
        raise UserError(
            f"mixed_precision {launch.launcher_precision} in {launch.source} != {wanted} "
            f"(train.mixed_precision {recipe_source:{key}}): add train.mixed_precision="
            f"{launch.launcher_precision} to the command, or pass --mixed_precision {wanted} to the launcher"
        )
    if wanted == "fp16" and launch.on_cpu:
        raise UserError(f"{key} fp16 {recipe_source:{key}} needs a GPU: use bf16 or no without one")
    if wanted == "bf16" and machine.gpu_count and not machine.bf16:
        gpu = machine.gpu_names[0] if machine.gpu_names else "this GPU"
        raise UserError(f"train.mixed_precision bf16 {recipe_source:{key}}: {gpu} has no bf16, use fp16")


def _check_deepspeed(launch: Launch, train: TrainConfig, recipe_source: str, ga: int) -> None:
    refuse_left_locks()  # DeepSpeed loads its compiled ops through torch's build lock
    if launch.ds_config_file and launch.ds_settings:
        raise UserError(
            f"{launch.source}: {', '.join(launch.ds_settings)} beside deepspeed_config_file are refused by "
            f"accelerate: set them in {launch.ds_config_file} (or leave them to the recipe config)"
        )
    where = launch.ds_config_file or launch.source
    values = dotted(launch.ds_config) if launch.ds_config_file else launch.ds_settings
    refuse_deepspeed_sections(launch.ds_config, launch.zero_stage, where)
    for key, expected, recipe_key in _recipe_values(train, ga, launch.world_size):
        found = values.get(key, "auto")
        if str(found).lower() != "auto" and not _same(found, expected):
            raise UserError(
                f"{key} {_show(found)} in {where} != {_show(expected)} "
                f"({recipe_key} {recipe_source:{recipe_key}})"
            )
    for block in ("optimizer", "scheduler"):
        if block in launch.ds_config:
            raise UserError(f"{where}: remove the {block} block, the recipe config builds the {block}")
    param_key = "zero_optimization.offload_param.device" if launch.ds_config_file else "offload_param_device"
    if launch.zero_stage < 3 and str(values.get(param_key, "none")).lower() != "none":
        raise UserError(
            f"{where}: parameter offload is ignored below ZeRO-3 (stage {launch.zero_stage}): remove it"
        )
    gather_key, gathers = gather_setting(launch.ds_config.get("zero_optimization") or {})
    if launch.zero_stage == 3 and str(gathers).lower() == "false":
        raise UserError(
            f"{where}: set zero_optimization.{gather_key} to true, "
            "or the final model cannot be gathered from the ZeRO-3 shards"
        )


def _recipe_values(train: TrainConfig, ga: int, world: int) -> list[tuple[str, object, str]]:
    """DeepSpeed keys the recipe config decides, with the value it implies and where that comes from."""
    precision = f"train.mixed_precision {train.mixed_precision}"
    return [
        ("train_batch_size", train.global_batch_size, "train.global_batch_size"),
        ("train_micro_batch_size_per_gpu", train.micro_batch_size, "train.micro_batch_size"),
        (
            "gradient_accumulation_steps",
            ga,
            f"train.global_batch_size / (train.micro_batch_size x {world} processes)",
        ),
        ("gradient_clipping", train.max_grad_norm, "train.max_grad_norm"),
        ("fp16.enabled", train.mixed_precision == "fp16", precision),
        ("bf16.enabled", train.mixed_precision == "bf16", precision),
    ]


def _same(found, expected) -> bool:
    if isinstance(expected, bool):
        return str(found).lower() == str(expected).lower()
    try:
        return float(found) == float(expected)
    except (TypeError, ValueError):
        return False


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _disable_nccl_p2p(machine: Machine, env: MutableMapping[str, str]) -> list[str]:
    """Consumer Ada cards report no peer-to-peer access, and NCCL can hang trying anyway."""
    if machine.gpu_count < 2 or machine.p2p or not any(GEFORCE_40.search(name) for name in machine.gpu_names):
        return []
    unset = [var for var in NCCL_P2P_VARS if var not in env]
    for var in unset:
        env[var] = "1"
    if not unset:
        return []
    return [
        f"RTX 40xx GPUs without peer-to-peer access: the launch sets {' and '.join(f'{v}=1' for v in unset)}"
    ]
