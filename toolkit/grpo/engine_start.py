"""The engines a GRPO run samples with, started or connected to: ftkit's own (grpo.vllm.replicas copies,
each on its GPUs or its share of this machine's cores, serving model.path or the base a start adapter is
folded into) or the user's at grpo.vllm.url."""

from __future__ import annotations

import os
from pathlib import Path

from toolkit.checkpoint.export import write_folded_base
from toolkit.engine.replicas import Replicas
from toolkit.engine.server import Engine, ServeSpec, has_gpu
from toolkit.errors import UserError
from toolkit.grpo.config import GrpoRecipeConfig, engine_gpus, replica_gpus, sleep_level

FOLDED_BASE = "base"
"""Under the run's engine/: model.path with model.adapter folded in, the base ftkit's engine serves."""


def start_or_connect(cfg, folder) -> Replicas:
    """The engine at grpo.vllm.url, or grpo.vllm.replicas engines started (each logs to its own file)."""
    settings = cfg.grpo.vllm
    if settings.url:
        return Replicas([Engine.connect(settings.url)])
    model, engines = served_base(cfg, folder), []
    cores = core_shares(settings.replicas) if not has_gpu() else [""] * settings.replicas
    try:
        for replica, gpus in enumerate(replica_gpus(cfg)):
            log = folder / ("vllm.log" if replica == 0 else f"vllm-{replica + 1}.log")
            port = settings.port + replica if settings.port else 0
            spec = serve_spec(cfg, model, gpus, cores[replica])
            engines.append(Engine.start(spec, log, settings.host, port))
    except UserError:
        Replicas(engines).stop()
        raise
    return Replicas(engines)


def core_shares(replicas: int) -> list[str]:
    """CPU engines: this process's cores split in order between the copies ("" each for one engine)."""
    cores = sorted(os.sched_getaffinity(0))
    if replicas == 1 or len(cores) < replicas:
        return [""] * replicas
    shares = [cores[len(cores) * i // replicas : len(cores) * (i + 1) // replicas] for i in range(replicas)]
    return [",".join(map(str, share)) for share in shares]


def serve_spec(cfg, model: str, gpus: list[str], cpus: str = "") -> ServeSpec:
    settings = cfg.grpo.vllm
    return ServeSpec(
        model=model,
        reloads_weights=cfg.model.method == "full",
        dtype=engine_dtype(cfg),
        max_model_len=cfg.data.max_length + cfg.grpo.max_new_tokens,
        lora_rank=cfg.lora.r if cfg.model.method != "full" else 0,
        trust_remote_code=cfg.model.trust_remote_code,
        kv_cache_gb=settings.kv_cache_gb,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        sleep=sleep_level(cfg, has_gpu()) > 0,
        gpus=",".join(gpus),
        tensor_parallel_size=settings.tensor_parallel_size or len(gpus),
        cpus=cpus,
    )


def served_base(cfg, folder: Path) -> str:
    """The base the engine serves: model.path, or with a start adapter the folded base written under the
    run's engine/ folder (the trainer folds the same adapter into the same base)."""
    if not cfg.model.adapter:
        return cfg.model.path
    target = folder / FOLDED_BASE
    write_folded_base(cfg.model.path, cfg.model.adapter, target, cfg.model.dtype, cfg.model.trust_remote_code)
    return str(target.resolve())


def engine_dtype(cfg) -> str:
    """The dtype the trainer computes in, so the engine's log-probs are comparable with its own."""
    precision = {"bf16": "bfloat16", "fp16": "float16"}.get(cfg.train.mixed_precision)
    if precision:
        return precision
    return cfg.model.dtype if cfg.model.dtype in ("float32", "bfloat16", "float16") else "auto"


def check_engine_environment(cfg: GrpoRecipeConfig) -> None:
    """Before the run writes anything: an engine ftkit would start needs its environment (.venv-vllm), an
    engine at grpo.vllm.url must answer, and so must an OpenEnv server (or ftkit's app be found). Not part
    of `validate_grpo`, which also checks configs planned for another machine."""
    from toolkit.engine import server
    from toolkit.grpo import openenv

    if cfg.grpo.generation == "vllm" and cfg.grpo.vllm.url:
        server.check_answers(cfg.grpo.vllm.url.rstrip("/"))
    elif cfg.grpo.generation == "vllm":
        import os

        server.engine_python(server.ENGINE_VENV)
        check_engine_machine(cfg, server.has_gpu(), dict(os.environ))
        if not server.has_gpu():
            server.check_cpu_head_size(cfg.model.path)
    if openenv.configured(cfg.grpo):
        openenv.check_before_run(cfg.grpo.environment.openenv)


def check_engine_machine(cfg: GrpoRecipeConfig, gpu: bool, env: dict[str, str]) -> None:
    """grpo.vllm.sleep and grpo.vllm.gpus against this machine: `gpu`, whether it has one; `env`, the
    launch's environment (its local world size and visible devices)."""
    if cfg.grpo.vllm.sleep and not gpu:
        raise UserError(
            "grpo.vllm.sleep: no GPU here, and vLLM's CPU backend has no sleep mode (vLLM refuses "
            "--enable-sleep-mode there); leave it unset or false"
        )
    gpus = engine_gpus(cfg)
    if gpus and not gpu:
        raise UserError(f"grpo.vllm.gpus: {','.join(gpus)} named, but no GPU here (nvidia-smi not found)")
    if cfg.grpo.vllm.replicas > 1 and gpu and not gpus:
        raise UserError(
            f"grpo.vllm.replicas: {cfg.grpo.vllm.replicas} engines need GPUs of their own, apart from "
            f"training's ({','.join(training_gpus(env))}): name them in grpo.vllm.gpus"
        )
    shared = sorted(set(gpus) & set(training_gpus(env)), key=int)
    if shared:
        raise UserError(
            f"grpo.vllm.gpus: GPU {','.join(shared)} also trains (this launch's processes use "
            f"{','.join(training_gpus(env))}); name GPUs apart from training's"
        )


def training_gpus(env: dict[str, str]) -> list[str]:
    """The GPUs this machine's training processes use, as nvidia-smi numbers them: the first
    LOCAL_WORLD_SIZE of CUDA_VISIBLE_DEVICES (accelerate gives local process i device i)."""
    local = int(env.get("LOCAL_WORLD_SIZE", "1"))
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",")] if visible else [str(i) for i in range(local)]
    return ids[:local]
