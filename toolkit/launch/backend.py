"""The distributed backend a launch asked for, and making accelerate deliver exactly that, GPU or not.

toolkit/run.py asks for the Accelerator in one call; this module builds it and checks the result:

    launch = backend.detect_launch()
    notes = checks.check_launch(launch, cfg, config_path, machine.probe_machine(), os.environ)
    ga = batches.grad_accum_steps(cfg.train, launch.mesh.data_parallel)
    accelerator = backend.setup(launch, cfg.train, ga, project_dir=..., ...)
    log(backend.setup_summary(accelerator, launch, cfg.train, ga)), then each of `notes`
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import (
    DistributedType,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    ParallelismConfig,
)

from toolkit.config import TrainConfig
from toolkit.errors import UserError
from toolkit.launch.machine import count_gpus
from toolkit.launch.mesh import Mesh
from toolkit.launch.sections import PARALLEL_SIZES, gather_setting

# Accelerate-native DeepSpeed settings: env variable `accelerate launch` sets -> the YAML key it came from.
DS_SETTINGS_ENV = {
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "zero_stage",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "gradient_accumulation_steps",
    "ACCELERATE_GRADIENT_CLIPPING": "gradient_clipping",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "offload_optimizer_device",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "offload_param_device",
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "zero3_save_16bit_model",
}
ENV_SOURCE = "the accelerate launch environment"
# FSDP settings the launch checks read: env variable `accelerate launch` sets -> YAML key without fsdp_.
FSDP_SETTINGS_ENV = {
    "FSDP_OFFLOAD_PARAMS": "offload_params",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "transformer_layer_cls_to_wrap",
    "FSDP_STATE_DICT_TYPE": "state_dict_type",
    "FSDP_USE_ORIG_PARAMS": "use_orig_params",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "cpu_ram_efficient_loading",
}


@dataclass(frozen=True)
class Launch:
    """What the launcher asked for, read from the environment `accelerate launch` sets or from its YAML."""

    backend: str
    """single | ddp | fsdp | deepspeed | tp (tensor parallel across every process, no FSDP) | pp (pipeline
    stages, replicated by data parallel when there are more processes than stages)."""
    world_size: int
    """Processes on all machines together."""
    procs_per_node: int
    """Processes on this machine."""
    on_cpu: bool
    """No GPU here: the backend runs on gloo CPU processes (a dry run of the same command)."""
    source: str = ENV_SOURCE
    """Where the request came from, for messages (an accelerate YAML, or the launch environment)."""
    fsdp_version: int = 0
    """1 or 2 with FSDP, else 0."""
    zero_stage: int = 0
    """ZeRO stage with DeepSpeed, else 0."""
    ds_config_file: str = ""
    """DeepSpeed JSON the YAML points to ("" for accelerate-native DeepSpeed settings)."""
    ds_config: dict = field(default_factory=dict)
    """That JSON's content."""
    ds_settings: dict = field(default_factory=dict)
    """Accelerate-native DeepSpeed settings given to the launcher (YAML deepspeed_config keys), as strings."""
    launcher_precision: str = ""
    """mixed_precision given to the launcher; "" when unset (a launched process cannot tell unset from no)."""
    fsdp_settings: dict = field(default_factory=dict)
    """FSDP settings given to the launcher, keys without the fsdp_ prefix (offload_params, ...)."""
    parallel_sizes: dict = field(default_factory=dict)
    """parallelism_config sizes given to the launcher (dp_replicate, dp_shard, tp, cp, sp)."""

    @property
    def mesh(self) -> Mesh:
        """How the processes split the work: replicas, shards, tensor-parallel groups."""
        return Mesh.of(self.parallel_sizes, self.world_size, self.backend == "fsdp")

    @property
    def uses_mesh(self) -> bool:
        """A parallelism_config with a size above 1 was given (ftkit then installs accelerate's mesh)."""
        return any(size > 1 for size in self.parallel_sizes.values())


def detect_launch(env: Mapping[str, str] | None = None, gpu_count: int | None = None) -> Launch:
    """Read what `accelerate launch` asked for from its environment (a plain `python` run is `single`)."""
    env = os.environ if env is None else env
    gpu_count = count_gpus() if gpu_count is None else gpu_count
    if _flag(env, "ACCELERATE_USE_MEGATRON_LM"):
        raise UserError(
            "Megatron-LM launches are not supported: use ddp, fsdp or a zero*.yaml accelerate config"
        )
    world = int(env.get("WORLD_SIZE", "1"))
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no")
    # The launcher passes "no" when nothing was given; DeepSpeed launches also list the YAML keys passed on.
    explicit = precision != "no" or "mixed_precision" in env.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",")
    common = dict(
        world_size=world,
        procs_per_node=int(env.get("LOCAL_WORLD_SIZE", str(world))),
        on_cpu=gpu_count == 0,
        launcher_precision=precision if explicit else "",
        source=ENV_SOURCE,
        parallel_sizes={
            name: int(env[f"PARALLELISM_CONFIG_{name.upper()}_SIZE"])
            for name in PARALLEL_SIZES
            if f"PARALLELISM_CONFIG_{name.upper()}_SIZE" in env
        },
    )
    if _flag(env, "ACCELERATE_USE_DEEPSPEED"):
        settings = {key: env[var] for var, key in DS_SETTINGS_ENV.items() if var in env}
        return deepspeed_launch(env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", ""), settings, **common)
    if _flag(env, "ACCELERATE_USE_FSDP"):
        fsdp = {key: env[var] for var, key in FSDP_SETTINGS_ENV.items() if var in env}
        launch = Launch("fsdp", fsdp_version=int(env.get("FSDP_VERSION", "1")), fsdp_settings=fsdp, **common)
        return as_tensor_parallel(launch)
    return as_tensor_parallel(Launch("ddp" if world > 1 else "single", **common))


def as_tensor_parallel(launch: Launch) -> Launch:
    """`launch` as backend `tp` when its mesh splits the model across every process (one data-parallel
    group). accelerate launch takes a parallelism_config only under FSDP2, which then has nothing to shard,
    so such a launch runs without FSDP: the split model, no wrapper, every rank on the same batch."""
    mesh = launch.mesh
    if launch.backend in ("fsdp", "ddp") and mesh.tp > 1 and mesh.data_parallel == 1:
        return dataclasses.replace(launch, backend="tp")
    return launch


def with_pipeline(launch: Launch, size: int, where: str) -> Launch:
    """`launch` as backend `pp` when the recipe asks for a pipeline of `size` processes (pipeline.size):
    its processes form world / size pipelines, each one data-parallel replica. accelerate has no pipeline
    of its own, so the launch is a plain multi-process one (accelerate_configs/pp.yaml, pp_ddp.yaml)."""
    if size == 1:
        return launch
    if launch.backend not in ("ddp", "single") or launch.parallel_sizes:
        raise UserError(
            f"{where}: pipeline.size {size} runs on a plain multi-process launch (accelerate_configs/pp.yaml "
            f"or pp_ddp.yaml), not under {backend_name(launch)} from {launch.source}"
        )
    if launch.world_size % size or launch.world_size < size:
        raise UserError(
            f"{where}: pipeline.size {size} does not divide the {launch.world_size} launched process(es): "
            f"launch a multiple of {size} (accelerate_configs/pp.yaml starts 2, pp_ddp.yaml 4)"
        )
    sizes = {"dp_replicate": launch.world_size // size, "pp": size}
    return dataclasses.replace(launch, backend="pp", parallel_sizes=sizes)


def deepspeed_launch(config_file: str, settings: dict, **common) -> Launch:
    """A DeepSpeed Launch from its JSON (if any) and accelerate-native settings (stage 2 unless given)."""
    ds_config = read_ds_config(config_file, common["source"]) if config_file else {}
    stage = ds_config.get("zero_optimization", {}).get("stage", settings.get("zero_stage", 2))
    return Launch(
        "deepspeed",
        zero_stage=int(stage),
        ds_config_file=config_file,
        ds_config=ds_config,
        ds_settings=settings,
        **common,
    )


def read_ds_config(path: str, source: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"DeepSpeed config {path} (deepspeed_config_file in {source}) not found")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def setup(launch: Launch, train: TrainConfig, grad_accum_steps: int, **options) -> Accelerator:
    """The Accelerator for the launched backend, checked to have joined every process into it.

    `options` are further `Accelerator` arguments (trackers, project_dir, ...); the backend, precision and
    accumulation come from `launch` and `train` only (passing one of those again is a TypeError).
    """
    accelerator = Accelerator(**accelerator_kwargs(launch, train, grad_accum_steps), **options)
    _finish_setup(accelerator, launch)
    return accelerator


def accelerator_kwargs(launch: Launch, train: TrainConfig, grad_accum_steps: int) -> dict:
    """Keyword arguments for `Accelerator(...)` giving the launched backend, on GPUs or gloo CPU processes.

    Precision always comes from the recipe: the Accelerator's argument overrides a YAML's mixed_precision.
    The recipe's loss is token-weighted across micro-batches, so accumulation never follows the dataloader.
    """
    refuse_unsupported(launch)
    kwargs = {
        "mixed_precision": train.mixed_precision,
        "gradient_accumulation_plugin": GradientAccumulationPlugin(
            num_steps=grad_accum_steps, sync_with_dataloader=False
        ),
    }
    if launch.on_cpu and launch.backend in ("ddp", "fsdp", "tp", "pp"):
        # Without cpu=True, accelerate finds no GPU and gives each launched process a world of its own.
        kwargs["cpu"] = True
    if launch.on_cpu and launch.backend == "fsdp":
        kwargs["fsdp_plugin"] = _cpu_fsdp_plugin(launch.fsdp_version)
    # A stalled rank fails the collective after this long instead of hanging the job forever; the watchdog
    # (toolkit/train/watchdog.py) reports first, and the main process may prepare data meanwhile.
    group = {"timeout": timedelta(minutes=2 * train.stall_timeout_minutes)}
    if launch.backend == "deepspeed":
        kwargs["deepspeed_plugin"] = deepspeed_plugin(train, grad_accum_steps)
        if launch.on_cpu:
            # DeepSpeed's CPU accelerator would otherwise ask for oneCCL.
            group["backend"] = "gloo"
    kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(**group)]
    if launch.uses_mesh:
        # accelerate checks a mesh as it builds the state: it refuses one on gloo CPU processes (MULTI_CPU,
        # before FSDP is switched on below) and a tensor-parallel-only mesh under the FSDP launch it came
        # from. The launch's mesh is installed in `_finish_setup`, once the type is right.
        kwargs["parallelism_config"] = ParallelismConfig(
            dp_replicate_size=1, dp_shard_size=1, tp_size=1, cp_size=1, sp_size=1
        )
    return kwargs


def refuse_unsupported(launch: Launch) -> None:
    """Raise for launches this machine cannot run, before accelerate fails with a less direct message."""
    if launch.backend == "deepspeed" and not deepspeed_installed():
        raise UserError(
            f"{launch.source} asks for DeepSpeed, which is not installed: pip install 'ftkit[deepspeed]'"
        )


def deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def deepspeed_plugin(train: TrainConfig, grad_accum_steps: int):
    """The launched DeepSpeed settings, each "auto" batch, accumulation and clipping field from the recipe.

    Accelerate alone would fill `gradient_clipping: auto` with 1.0 whatever the recipe says, and leave
    ZeRO-3 unable to gather a full state dict; the Accelerator fills precision from its mixed_precision.
    """
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(
        gradient_accumulation_steps=grad_accum_steps,
        gradient_clipping=train.max_grad_norm,
        zero3_save_16bit_model=True,
    )
    config = plugin.deepspeed_config
    for key, value in (
        ("train_micro_batch_size_per_gpu", train.micro_batch_size),
        ("train_batch_size", train.global_batch_size),
    ):
        if config.get(key, "auto") == "auto":
            config[key] = value
    zero = config["zero_optimization"]
    key, value = gather_setting(zero)
    if value == "auto":
        zero[key] = True
    return plugin


def _cpu_fsdp_plugin(version: int):
    """FSDP settings from the launch, minus the two that need a GPU to move meta weights onto (FSDP2 has
    no sync_module_states, and accelerate warns when it is given).

    FSDP1 checkpoints are sharded on CPU: gathering a FULL_STATE_DICT onto rank 0 over gloo crashes it
    (SIGSEGV) inside torch, and ftkit's export gathers the full model from sharded checkpoints itself."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    v1 = {"sync_module_states": False, "state_dict_type": "SHARDED_STATE_DICT"} if version == 1 else {}
    return FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=False, **v1)


def _finish_setup(accelerator, launch: Launch) -> None:
    """Switch on FSDP where accelerate skipped it for lack of a GPU, then `verify` the result."""
    if (
        launch.on_cpu
        and launch.backend == "fsdp"
        and accelerator.distributed_type == DistributedType.MULTI_CPU
    ):
        state = accelerator.state
        plugin = _cpu_fsdp_plugin(launch.fsdp_version)
        if state.mixed_precision != "no":
            plugin.set_mixed_precision(state.mixed_precision)
        state.fsdp_plugin = plugin
        state.distributed_type = DistributedType.FSDP
        # Every later AcceleratorState() copies PartialState's fields over its own.
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        if launch.fsdp_version == 1:
            # FSDP1 computes on `cpu` and refuses accelerate's `cpu:0` as a different device.
            state.device = PartialState._shared_state["device"] = torch.device("cpu")
    if launch.backend == "tp":
        _without_fsdp(accelerator.state)
    if launch.uses_mesh:
        _install_mesh(accelerator, launch.mesh)
    verify(accelerator, launch)


def _without_fsdp(state) -> None:
    """Plain multi-process state for a model split across every process (the FSDP launch it came from
    has nothing to shard); on gloo CPU processes accelerate never switched FSDP on."""
    if state.distributed_type != DistributedType.FSDP:
        return
    state.fsdp_plugin = None
    state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def _install_mesh(accelerator, mesh: Mesh) -> None:
    """Give accelerate the launch's device mesh, now that the state has its final type.

    A pipeline's processes are given as its `tp` dimension: like tensor-parallel ranks they share their
    batches (accelerate's loaders then shard by replica) and take no DDP wrapper (toolkit/pipeline
    averages each stage's gradients over the replicas, accelerate's `dp_shard` dimension).

    accelerate's own check of the mesh runs for FSDP2. It refuses a tensor-parallel-only launch on CPU
    processes (MULTI_CPU), although that trains exactly (accelerate puts no DDP wrapper around a split
    model); `checks.check_launch` has checked its sizes.

    Under FSDP x TP accelerate is told of the data-parallel dimensions only: its tensor-parallel preparation
    (1.15) imports a transformers class that transformers 5 no longer has, and ftkit has split the model
    itself. FSDP shards over the data-parallel dimensions of the whole mesh, and the loaders read the whole
    mesh, so tensor-parallel ranks still share their batches."""
    if mesh.pp > 1:
        # accelerate takes tp only with a dp_shard dimension; nothing is sharded, it names the replicas.
        config = ParallelismConfig(dp_replicate_size=1, dp_shard_size=mesh.data_parallel, tp_size=mesh.pp)
    else:
        config = ParallelismConfig(
            dp_replicate_size=mesh.dp_replicate, dp_shard_size=mesh.dp_shard, tp_size=mesh.tp
        )
    state = accelerator.state
    state.parallelism_config = config
    state.device_mesh = config.get_device_mesh(accelerator.device.type)
    if state.distributed_type == DistributedType.FSDP:
        config._validate_accelerator(accelerator)
        if mesh.tp > 1:
            state.parallelism_config = ParallelismConfig(
                dp_replicate_size=mesh.dp_replicate, dp_shard_size=mesh.dp_shard, tp_size=1
            )


# The accelerate type each backend must end up as; ddp is any MULTI_<device> type.
DISTRIBUTED_TYPE = {
    "single": DistributedType.NO,
    "fsdp": DistributedType.FSDP,
    "deepspeed": DistributedType.DEEPSPEED,
}


def verify(accelerator, launch: Launch) -> None:
    """Refuse to train unless accelerate joined every launched process into the backend that was asked for."""
    got = accelerator.distributed_type
    if accelerator.num_processes != launch.world_size:
        raise UserError(
            f"{launch.world_size} processes were launched ({launch.backend}, WORLD_SIZE) but accelerate "
            f"joined {accelerator.num_processes} ({got.value}): each process would train alone"
        )
    if launch.backend in ("ddp", "tp", "pp"):
        matches = got.value.startswith("MULTI_")
    else:
        matches = got == DISTRIBUTED_TYPE[launch.backend]
    if not matches:
        raise UserError(f"{launch.source} asked for {launch.backend} but accelerate set up {got.value}")


def setup_summary(accelerator, launch: Launch, train: TrainConfig, grad_accum_steps: int) -> str:
    """One line: backend, world size, processes per node, device, precision, how the global batch is made."""
    ga = grad_accum_steps
    world = accelerator.num_processes
    comm = torch.distributed.get_backend() if torch.distributed.is_initialized() else "none"
    return (
        f"backend {backend_name(launch)} ({comm}) | world {world} | {launch.procs_per_node} per node | "
        f"device {accelerator.device.type} | precision {accelerator.mixed_precision} | "
        f"global batch {train.micro_batch_size * ga * launch.mesh.data_parallel} = "
        f"micro {train.micro_batch_size} x GA {ga} x {batch_split(launch)}"
    )


def batch_split(launch: Launch) -> str:
    """`world 4`, or where tensor-parallel ranks share batches `data-parallel 2 (world 4 / tp 2)`."""
    mesh = launch.mesh
    if mesh.pp > 1:
        return f"data-parallel {mesh.data_parallel} (world {launch.world_size} / pp {mesh.pp})"
    if mesh.tp == 1:
        return f"world {launch.world_size}"
    return f"data-parallel {mesh.data_parallel} (world {launch.world_size} / tp {mesh.tp})"


def backend_name(launch: Launch) -> str:
    fsdp = f"fsdp{launch.fsdp_version}"
    if launch.mesh.describe(fsdp):
        return launch.mesh.describe(fsdp)
    if launch.backend == "deepspeed":
        return f"deepspeed ZeRO-{launch.zero_stage}" + (" + offload" if _offloads(launch) else "")
    if launch.backend == "fsdp":
        return fsdp
    return launch.backend


def _offloads(launch: Launch) -> bool:
    zero = launch.ds_config.get("zero_optimization", {})
    devices = [zero.get(key, {}).get("device") for key in ("offload_optimizer", "offload_param")]
    devices += [launch.ds_settings.get(key) for key in ("offload_optimizer_device", "offload_param_device")]
    return any(str(device).lower() not in ("none", "") for device in devices if device is not None)


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "false").lower() in ("1", "true", "yes")
