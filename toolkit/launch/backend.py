"""The distributed backend a launch asked for, and making accelerate deliver exactly that, GPU or not.

toolkit/run.py asks for the Accelerator in one call; this module builds it and checks the result:

    launch = backend.detect_launch()
    notes = checks.check_launch(launch, cfg, facts, config_path, machine.probe_machine(), os.environ)
    ga = batches.grad_accum_steps(cfg.train, launch.mesh.data_parallel)
    accelerator = backend.setup(launch, cfg.train, ga, project_dir=..., ...)
    log(backend.setup_summary(accelerator, launch, cfg.train, ga)), then each of `notes`

What only one backend family needs lives beside it: deepspeed.py, fsdp.py, model_parallel.py (meshes and
pipelines); the `Launch` they all read is in request.py.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DeepSpeedSequenceParallelConfig,
    DistributedType,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    ParallelismConfig,
)

from toolkit.config import TrainConfig
from toolkit.errors import UserError
from toolkit.launch.deepspeed import (
    DS_SETTINGS_ENV,
    deepspeed_installed,
    deepspeed_plugin,
    read_ds_config,
    zero_stage,
)
from toolkit.launch.fsdp import FSDP_SETTINGS_ENV, cpu_fsdp_plugin, switch_on_cpu_fsdp
from toolkit.launch.machine import count_gpus
from toolkit.launch.mesh import Mesh
from toolkit.launch.model_parallel import install_mesh, without_fsdp
from toolkit.launch.request import ENV_SOURCE, Launch, backend_name, batch_split
from toolkit.launch.sections import PARALLEL_SIZES


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
    return Launch(
        "deepspeed",
        zero_stage=zero_stage(ds_config, settings),
        ds_config_file=config_file,
        ds_config=ds_config,
        ds_settings=settings,
        **common,
    )


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
        kwargs["fsdp_plugin"] = cpu_fsdp_plugin(launch.fsdp_version)
    # A stalled rank fails the collective after this long instead of hanging the job forever; the watchdog
    # (toolkit/train/watchdog.py) reports first, and the main process may prepare data meanwhile.
    group = {"timeout": timedelta(minutes=2 * train.stall_timeout_minutes)}
    if launch.backend == "deepspeed":
        kwargs["deepspeed_plugin"] = deepspeed_plugin(train, grad_accum_steps, launch.mesh.sp)
        if launch.on_cpu:
            # DeepSpeed's CPU accelerator would otherwise ask for oneCCL.
            group["backend"] = "gloo"
    kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(**group)]
    if launch.mesh.sp > 1:
        # DeepSpeed builds its own sequence-parallel groups; accelerate swaps the attention in `prepare`.
        kwargs["parallelism_config"] = sequence_parallel_config(launch.mesh)
    elif launch.uses_mesh:
        # accelerate checks a mesh as it builds the state: it refuses one on gloo CPU processes (MULTI_CPU,
        # before FSDP is switched on below) and a tensor-parallel-only mesh under the FSDP launch it came
        # from. The launch's mesh is installed in `_finish_setup`, once the type is right.
        kwargs["parallelism_config"] = ParallelismConfig(
            dp_replicate_size=1, dp_shard_size=1, tp_size=1, cp_size=1, sp_size=1
        )
    return kwargs


def sequence_parallel_config(mesh: Mesh) -> ParallelismConfig:
    """accelerate's settings for DeepSpeed's Ulysses attention: sequence lengths vary from batch to batch
    (the collators pad each batch to its longest row), the kernel is the launch's (sdpa unless set)."""
    handler = DeepSpeedSequenceParallelConfig(
        sp_seq_length_is_variable=True, sp_attn_implementation=sequence_parallel_attention(os.environ)
    )
    return ParallelismConfig(
        dp_replicate_size=mesh.dp_replicate,
        dp_shard_size=mesh.dp_shard,
        sp_size=mesh.sp,
        sp_backend="deepspeed",
        sp_handler=handler,
    )


def sequence_parallel_attention(env: Mapping[str, str]) -> str:
    """The attention kernel a sequence-parallel launch asked for (accelerate's default: sdpa)."""
    value = env.get("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION", "None")
    return "sdpa" if value in ("", "None") else value


def refuse_unsupported(launch: Launch) -> None:
    """Raise for launches this machine cannot run, before accelerate fails with a less direct message."""
    if launch.backend == "deepspeed" and not deepspeed_installed():
        raise UserError(
            f"{launch.source} asks for DeepSpeed, which is not installed: pip install 'ftkit[deepspeed]'"
        )


def _finish_setup(accelerator, launch: Launch) -> None:
    """Switch on FSDP where accelerate skipped it for lack of a GPU, then `verify` the result."""
    if launch.on_cpu and launch.backend == "fsdp":
        switch_on_cpu_fsdp(accelerator, launch.fsdp_version)
    if launch.backend == "tp":
        without_fsdp(accelerator.state)
    if launch.uses_mesh and launch.mesh.sp == 1:
        install_mesh(accelerator, launch.mesh)
    verify(accelerator, launch)


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


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "false").lower() in ("1", "true", "yes")
