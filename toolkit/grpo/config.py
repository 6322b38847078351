"""The GRPO recipe's config: the shared recipe config plus a `grpo` section."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Literal

from toolkit.config import RecipeConfig, check_local_path, load_config
from toolkit.errors import UserError
from toolkit.fields import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Range
from toolkit.model import scalar

DEMO_GRPO_CONFIG = Path(__file__).resolve().parents[1] / "assets" / "demo-grpo.yaml"

GrpoLoss = Literal["grpo", "dr_grpo", "dapo"]
Generation = Literal["hf", "vllm"]
ImportanceLevel = Literal["token", "sequence"]
ImportanceMode = Literal["truncate", "mask"]
RewardScaling = Literal["group", "batch", "none"]
BUILT_IN_REWARDS = ("exact_answer", "format", "length")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
DEFAULT_RESTARTS = 2
"""grpo.vllm.restarts unset, for the engine ftkit starts."""


@dataclass
class VllmConfig:
    url: str | None = None
    """An engine you started (http://host:port, serving model.path as "base" with --enable-lora); unset:
    ftkit starts one from .venv-vllm on the main process for the run and stops it at the end."""
    host: str = "127.0.0.1"
    """Address the engine ftkit starts listens on."""
    port: NonNegativeInt = 0
    """Port of the engine ftkit starts (0: a free one)."""
    start_timeout_s: PositiveFloat = 600.0
    """Seconds the engine may take to answer its health check."""
    kv_cache_gb: PositiveInt = 1
    """KV cache of a CPU engine (VLLM_CPU_KVCACHE_SPACE, GiB)."""
    gpu_memory_utilization: Annotated[float, Range(low=0, high=1, low_open=True)] = 0.3
    """Share of the GPU's memory a GPU engine takes (weights and KV cache)."""
    gpus: str | list[NonNegativeInt] | None = None
    """GPUs of the engine ftkit starts ("2,3" or [2, 3], as nvidia-smi numbers them), apart from the
    training processes'; unset: the main process's GPU, shared with training."""
    tensor_parallel_size: NonNegativeInt = 0
    """GPUs the engine ftkit starts splits the model over (0: the count of grpo.vllm.gpus, else 1)."""
    sleep: bool | None = None
    """The engine ftkit starts sleeps between rounds (vLLM's sleep mode, GPU only): its memory freed once
    a round's completions are back, taken again before the next sync. Unset: on when it shares the main
    process's GPU (no url, no gpus, grpo.async_rounds 0, a loopback host, a GPU here), off otherwise."""
    replicas: PositiveInt = 1
    """Copies of the engine ftkit starts (data parallel), a round's prompts split between them: each on
    grpo.vllm.tensor_parallel_size GPUs of its own from grpo.vllm.gpus on a GPU machine; here N CPU engines.
    The completions are the same as one engine's (each is decided by its prompt and seed)."""
    n_per_prompt: bool | None = None
    """One request per prompt asks for its group's grpo.num_generations completions (vLLM's n, the i-th
    seeded seed + i): the prompt is sent and prefilled once, the completions the same as asked one by one.
    Unset: on for single-turn rounds; a conversation's turns (grpo.environment) are asked one by one."""
    restarts: NonNegativeInt | None = None
    """Times the engine ftkit starts is started again when it dies or stops answering mid-run, the round
    going on (unset: 2; an engine at grpo.vllm.url is never restarted: 0). Past them the run saves a
    checkpoint and ends in one line saying how to continue."""


@dataclass
class OpenEnvConfig:
    url: str | None = None
    """An OpenEnv server you started (http://host:port): each conversation is one session on its /ws."""
    app: str | None = None
    """Or the server ftkit starts for the run, one per process on 127.0.0.1: an ASGI app (module:app from
    where you launch, or path/to/server.py:app) served by uvicorn in a process of its own, stopped at the
    end."""
    action_field: str = "message"
    """The action's field that carries the model's turn ({action_field: text})."""
    observation_field: str = ""
    """The observation's field whose text is the next user turn ("": the observation as JSON)."""
    reward_weight: float = 1.0
    """Weight of the environment's reward (the sum of its steps' rewards) in the total, beside
    grpo.rewards; it is logged as reward_environment either way (0: logged only)."""
    request_timeout_s: PositiveFloat = 30.0
    """Seconds a reset or step may take; past it the model reads a timeout error and the conversation ends."""
    start_timeout_s: PositiveFloat = 60.0
    """Seconds the server ftkit starts may take to answer /health."""


@dataclass
class EnvironmentConfig:
    tools: list[str] = field(default_factory=list)
    """Python functions the model may call, as module:function or path/to/file.py:function (type hints and
    a docstring with an Args section: their JSON schemas come from them); empty: single-turn GRPO."""
    tool_timeout_s: PositiveFloat = 5.0
    """Seconds a tool call may run; past it the model reads a timeout error as the tool's answer."""
    concurrency: PositiveInt = 8
    """Conversations whose tool calls (or OpenEnv resets and steps) of a turn run at once (1: one after
    another); the conversations come out the same either way."""
    openenv: OpenEnvConfig = field(default_factory=OpenEnvConfig)
    """An OpenEnv environment instead of tools (`pip install ftkit[openenv]`, docs/grpo.md): the model's
    turns are its actions, its observations the user turns between them."""


@dataclass
class GrpoConfig:
    num_generations: Annotated[int, Range(low=2)] = 8
    """Completions sampled per prompt (the group its advantages are normalised in)."""
    max_new_tokens: PositiveInt = 32
    """Tokens a completion may have (one that reaches it without its end token is cut there); with an
    environment, the whole conversation after the prompt: the model's turns and the tools' together."""
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    """Tools the model may call between its turns (multi-turn rollouts, docs/grpo.md); none by default."""
    max_turns: int = 4
    """With an environment: model turns a conversation may have (each tool answer gives it another)."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature."""
    top_p: Annotated[float, Range(low=0, high=1, low_open=True)] = 1.0
    """Nucleus sampling: keep the most likely tokens whose probability adds up to this (1: all)."""
    top_k: NonNegativeInt = 0
    """Keep only the k most likely tokens (0: all)."""
    steps_per_generation: PositiveInt = 1
    """Optimizer steps one generation round feeds, each on its own share of the round's completions."""
    iterations: PositiveInt = 1
    """Passes over a round's completions (GRPO's mu): more than 1 reuses them for further updates."""
    loss: GrpoLoss = "grpo"
    """Normalisation: grpo (each completion's token mean, averaged over completions) | dr_grpo (token
    sum over completions x max_new_tokens) | dapo (token mean over every completion token of the step)."""
    epsilon: PositiveFloat = 0.2
    """Lower clip of the policy ratio: 1 - epsilon."""
    epsilon_high: PositiveFloat | None = None
    """Upper clip of the policy ratio: 1 + epsilon_high (unset: epsilon; DAPO raises it, e.g. 0.28)."""
    beta: NonNegativeFloat = 0.0
    """Weight of the per-token KL to the reference (0: no reference is computed)."""
    scale_rewards: RewardScaling = "group"
    """Advantages: reward minus its group's mean, divided by the group's std (group), the round's std
    (batch), or nothing (none, as Dr. GRPO)."""
    rewards: list[str] = field(default_factory=lambda: ["exact_answer"])
    """Reward functions, summed: exact_answer (the completion equals the data's answer) | format (it
    matches grpo.format_pattern) | length (minus its share of max_new_tokens) | module:function or
    path/to/file.py:function (yours: f(prompts, completions, answers) -> list of floats, or
    f(trajectories) -> list of floats on whole conversations) | a reward model's folder
    (recipes/reward_llm.py's final/ or merged/, with the policy's tokenizer)."""
    reward_weights: list[float] = field(default_factory=list)
    """One weight per reward function (empty: 1 each)."""
    format_pattern: str = r"\S.*"
    """Regular expression the whole completion must match for the format reward."""
    generation_batch_size: NonNegativeInt = 0
    """Completions a process generates at once (0: its whole share of the round)."""
    gather_for_generation: bool = True
    """Under ZeRO-3/FSDP2, gather the whole model once per round for generation (false: layer by layer
    at every token, for a model whose full weights do not fit one device)."""
    generation: Generation = "hf"
    """What samples the completions: hf (generate on the training weights) | vllm (a vLLM engine, its LoRA
    adapter synced each round: `make install-vllm`, docs/grpo.md)."""
    engine_is_cap: NonNegativeFloat = 2.0
    """grpo.generation=vllm: each token's policy term weighted by the trainer's probability of it over the
    engine's, truncated at this (truncated importance sampling against their mismatch; 0: off)."""
    engine_is_level: ImportanceLevel = "token"
    """grpo.generation=vllm: the importance weight of each token (token) or one per completion, the product
    of its tokens' ratios (sequence)."""
    engine_is_mode: ImportanceMode = "truncate"
    """grpo.generation=vllm: a weight above grpo.engine_is_cap counts as the cap (truncate) | a weight
    outside [1 / cap, cap] drops its token (or completion) from the policy term (mask)."""
    async_rounds: Annotated[int, Range(low=0, high=1)] = 0
    """grpo.generation=vllm: 1 samples round k+1 on the engine while round k trains (multi-turn: the whole
    round, its environment's turns too), with the weights synced before round k (one round stale, corrected
    by grpo.engine_is_cap); 0: each round waits."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """The engine of grpo.generation=vllm: started by ftkit, or yours at grpo.vllm.url."""
    reference_model: str | None = None
    """Frozen reference for the KL term (path or hub id); unset: the policy with its adapter off (LoRA),
    required for a full fine-tune with grpo.beta > 0."""
    teacher: str | None = None
    """On-policy distillation: a model folder (or hub id), or an adapter folder whose adapter_config names
    its base, that scores every token the policy samples; its log-prob minus the policy's is the token's
    advantage, beside the rewards' (docs/grpo.md). Its tokenizer must be model.path's."""
    teacher_weight: PositiveFloat = 1.0
    """Weight of the teacher's per-token advantage against the rewards' group-normalised one."""


@dataclass
class GrpoRecipeConfig(RecipeConfig):
    output_dir: str = "runs/demo-grpo"
    """Where config.yaml, metrics.jsonl, checkpoints/ and final/ are written."""
    grpo: GrpoConfig = field(default_factory=GrpoConfig)


def load_grpo_config(path: str | Path | None, overrides: list[str]) -> GrpoRecipeConfig:
    """The recipe config at `path` (the demo when None), checked for what GRPO needs."""
    cfg = load_config(path or DEMO_GRPO_CONFIG, overrides, schema=GrpoRecipeConfig)
    validate_grpo(cfg)
    return cfg


def validate_grpo(cfg: GrpoRecipeConfig) -> None:
    grpo, train = cfg.grpo, cfg.train
    if cfg.data.packing or cfg.data.streaming:
        raise UserError("data.packing and data.streaming are for SFT; GRPO reads whole prompts")
    if cfg.pipeline.size > 1:
        raise UserError("pipeline.size: GRPO does not run on a pipeline yet; use tp or fsdp for large models")
    round_completions = train.global_batch_size * grpo.steps_per_generation
    if round_completions % grpo.num_generations:
        raise UserError(
            f"train.global_batch_size x grpo.steps_per_generation ({round_completions}) must be a multiple "
            f"of grpo.num_generations ({grpo.num_generations}): a round generates whole groups"
        )
    if grpo.reward_weights and len(grpo.reward_weights) != len(grpo.rewards):
        raise UserError(
            f"grpo.reward_weights: {len(grpo.reward_weights)} weights for {len(grpo.rewards)} grpo.rewards"
        )
    if not grpo.rewards and not grpo.teacher:
        raise UserError("grpo.rewards: name at least one reward function, or a grpo.teacher to distill from")
    for name in grpo.rewards:
        if Path(name).expanduser().is_dir() and not scalar.saved_scalar(name):
            raise UserError(
                f"grpo.rewards: {name} is a folder but not a reward model (recipes/reward_llm.py's)"
            )
        if name not in BUILT_IN_REWARDS and ":" not in name and not Path(name).expanduser().is_dir():
            raise UserError(
                f"grpo.rewards: unknown reward {name!r}; built in: {', '.join(BUILT_IN_REWARDS)}, "
                "yours as module:function, or a reward model's folder"
            )
    try:
        re.compile(grpo.format_pattern)
    except re.error as exc:
        raise UserError(f"grpo.format_pattern: not a regular expression ({exc})") from exc
    if grpo.beta > 0 and cfg.model.method == "full" and not grpo.reference_model:
        raise UserError("grpo.beta > 0 with model.method full needs grpo.reference_model (a frozen copy)")
    if grpo.max_turns < 1:
        raise UserError(f"grpo.max_turns: {grpo.max_turns} must be at least 1")
    served = bool(grpo.environment.openenv.url or grpo.environment.openenv.app)
    if served:
        validate_openenv(grpo.environment)
    if grpo.async_rounds and grpo.generation != "vllm":
        raise UserError(
            "grpo.async_rounds: 1 needs grpo.generation=vllm (HF generate runs on the training processes: "
            "there is nothing to overlap with)"
        )
    if grpo.async_rounds and grpo.engine_is_cap == 0:
        raise UserError(
            "grpo.async_rounds: 1 trains on samples of weights one round old, which grpo.engine_is_cap "
            "corrects; with grpo.engine_is_cap 0 nothing would: set a cap (2.0) or grpo.async_rounds 0"
        )
    if grpo.vllm.n_per_prompt and grpo.generation != "vllm":
        raise UserError(
            "grpo.vllm.n_per_prompt: HF generate cannot keep a seed per completion when one request asks for "
            "n (a group drawn from one generator); it samples each completion with its own seed: unset it"
        )
    if grpo.vllm.n_per_prompt and (grpo.environment.tools or served):
        raise UserError(
            "grpo.vllm.n_per_prompt: a conversation's turns after the first differ from its group's, so "
            "multi-turn rounds (grpo.environment) ask for them one by one: unset it"
        )
    if grpo.generation == "vllm":
        validate_engine(cfg)
    else:
        refuse_unused_engine_settings(grpo)
    user_rewards = [name for name in grpo.rewards if ":" in name and not scalar.saved_scalar(name)]
    if user_rewards:
        from toolkit.grpo.rewards import load_user_function  # imports the user's code: only when named

        for name in user_rewards:  # one not importable, or without the function: one line, nothing written
            load_user_function(name)
    if grpo.environment.tools:
        from toolkit.grpo.environment import Environment  # imports the user's tools: only when named

        Environment.build(grpo)  # a tool not importable or without type hints: one line, nothing written
    if grpo.reference_model:
        check_local_path(grpo.reference_model, "grpo.reference_model")


def validate_engine(cfg: GrpoRecipeConfig) -> None:
    """What the engine path does not do yet, refused in one line before anything loads."""
    if cfg.model.adapter and cfg.grpo.vllm.url:
        raise UserError(
            "grpo.vllm.url: model.adapter is folded into the trained base, which an engine you started does "
            "not serve; merge it into a model folder (`ftkit export --merge-lora`), serve that and name it "
            "as model.path, or leave grpo.vllm.url unset (ftkit's engine serves the folded base)"
        )
    if cfg.model.method == "full" and not cfg.grpo.vllm.url and cfg.grpo.vllm.host not in LOOPBACK:
        raise UserError(
            f"grpo.vllm.host: {cfg.grpo.vllm.host} would expose vLLM's development endpoints, which a full "
            "fine-tune's engine opens to reload its weights; keep it on 127.0.0.1"
        )
    validate_placement(cfg)
    if cfg.lora.use_dora:
        raise UserError(
            "grpo.generation=vllm: lora.use_dora adapters are not loaded by the engine; turn it off"
        )


def refuse_unused_engine_settings(grpo: GrpoConfig) -> None:
    """A grpo.vllm key set away from its default while HF generate samples: nothing would read it."""
    defaults = VllmConfig()
    for setting in fields(VllmConfig):
        if getattr(grpo.vllm, setting.name) != getattr(defaults, setting.name):
            raise UserError(
                f"grpo.vllm.{setting.name}: only applies with grpo.generation: vllm (it is "
                f"{grpo.generation}); drop it or set grpo.generation=vllm"
            )


def validate_placement(cfg: GrpoRecipeConfig) -> None:
    """grpo.vllm.sleep and grpo.vllm.gpus: what needs no look at the machine."""
    settings, grpo = cfg.grpo.vllm, cfg.grpo
    if settings.sleep and settings.url:
        raise UserError(
            "grpo.vllm.sleep: ftkit puts only the engine it starts to sleep, not yours at grpo.vllm.url"
        )
    if settings.sleep and grpo.async_rounds:
        raise UserError(
            "grpo.vllm.sleep: with grpo.async_rounds the engine generates while training runs; it cannot "
            "sleep"
        )
    if settings.sleep and settings.host not in LOOPBACK:
        raise UserError(
            f"grpo.vllm.host: {settings.host} would expose vLLM's development endpoints, which sleep mode "
            "opens; keep it on 127.0.0.1"
        )
    if settings.replicas > 1 and settings.url:
        raise UserError(
            "grpo.vllm.replicas: ftkit starts its copies of the engine; yours at grpo.vllm.url is one engine"
        )
    if settings.replicas > 1 and settings.sleep:
        raise UserError(
            "grpo.vllm.sleep: copies of the engine (grpo.vllm.replicas) run on GPUs of their own, apart "
            "from training's; there is no GPU to hand back: leave it unset"
        )
    if settings.restarts and settings.url:
        raise UserError(
            "grpo.vllm.restarts: ftkit restarts only the engine it starts, not yours at grpo.vllm.url"
        )
    gpus = engine_gpus(cfg)
    if gpus and settings.url:
        raise UserError(
            "grpo.vllm.gpus: places the engine ftkit starts; yours at grpo.vllm.url runs where you started it"
        )
    if len(set(gpus)) != len(gpus):
        raise UserError(f"grpo.vllm.gpus: {','.join(gpus)} names a GPU twice")
    if gpus and settings.tensor_parallel_size > len(gpus):
        raise UserError(
            f"grpo.vllm.tensor_parallel_size: {settings.tensor_parallel_size} is more than grpo.vllm.gpus "
            f"({len(gpus)})"
        )
    wanted = settings.replicas * max(1, settings.tensor_parallel_size)
    if gpus and len(gpus) < wanted:
        raise UserError(
            f"grpo.vllm.replicas: {settings.replicas} engines of {max(1, settings.tensor_parallel_size)} "
            f"GPU each need {wanted} GPUs; grpo.vllm.gpus names {len(gpus)} ({','.join(gpus)})"
        )


def replica_gpus(cfg: GrpoRecipeConfig) -> list[list[str]]:
    """Each engine copy's GPUs: grpo.vllm.gpus split in order, grpo.vllm.tensor_parallel_size each (unset:
    an equal share); [[]] * replicas when no GPUs are named."""
    gpus, replicas = engine_gpus(cfg), cfg.grpo.vllm.replicas
    if not gpus:
        return [[] for _ in range(replicas)]
    each = cfg.grpo.vllm.tensor_parallel_size or len(gpus) // replicas
    return [gpus[i * each : (i + 1) * each] for i in range(replicas)]


def n_per_prompt(cfg: GrpoRecipeConfig) -> bool:
    """grpo.vllm.n_per_prompt as the run uses it: unset, on for single-turn rounds."""
    setting = cfg.grpo.vllm.n_per_prompt
    if setting is not None:
        return setting
    environment = cfg.grpo.environment
    return not (environment.tools or environment.openenv.url or environment.openenv.app)


def engine_restarts(cfg: GrpoRecipeConfig) -> int:
    """grpo.vllm.restarts as the run uses it: unset, 2 for the engine ftkit starts and 0 for yours."""
    settings = cfg.grpo.vllm
    if settings.restarts is not None:
        return settings.restarts
    return 0 if settings.url else DEFAULT_RESTARTS


def engine_gpus(cfg: GrpoRecipeConfig) -> list[str]:
    """grpo.vllm.gpus as CUDA_VISIBLE_DEVICES entries ([] when unset)."""
    gpus = cfg.grpo.vllm.gpus
    if gpus is None or gpus == "":
        return []
    items = [str(g) for g in gpus] if isinstance(gpus, list) else [g.strip() for g in gpus.split(",")]
    if not all(item.isdigit() for item in items):
        raise UserError(f'grpo.vllm.gpus: {gpus!r} is not GPU indices ("2,3" or [2, 3])')
    return items


def sleep_level(cfg: GrpoRecipeConfig, gpu: bool) -> int:
    """vLLM's sleep level for the engine between rounds, 0 when it does not sleep: 1 (LoRA: its base
    weights kept in CPU memory) or 2 (full fine-tuning: its weights dropped, reloaded anyway)."""
    settings = cfg.grpo.vllm
    sleeps = settings.sleep
    if sleeps is None:
        sleeps = (
            gpu
            and not settings.url
            and not engine_gpus(cfg)
            and not cfg.grpo.async_rounds
            and settings.host in LOOPBACK
        )
    if not sleeps or cfg.grpo.generation != "vllm":
        return 0
    return 2 if cfg.model.method == "full" else 1


def validate_openenv(environment: EnvironmentConfig) -> None:
    settings = environment.openenv
    if environment.tools:
        raise UserError("grpo.environment: name tools or an OpenEnv environment (openenv), not both")
    if settings.url and settings.app:
        raise UserError("grpo.environment.openenv: name url (a server you started) or app (ftkit starts it)")
    if settings.url and not re.match(r"^(https?|wss?)://[^/\s]+/?$", settings.url):
        raise UserError(f"grpo.environment.openenv.url: {settings.url!r} is not http://host:port")
    if settings.app and not re.fullmatch(r"([\w.]+|.+\.py):[\w.]+", settings.app):
        raise UserError(f"grpo.environment.openenv.app: {settings.app!r} is not module:app or file.py:app")


def prompts_per_round(cfg: GrpoRecipeConfig) -> int:
    """Prompts one generation round samples completions for."""
    return cfg.train.global_batch_size * cfg.grpo.steps_per_generation // cfg.grpo.num_generations


def steps_per_round(cfg: GrpoRecipeConfig) -> int:
    """Optimizer steps between two generation rounds."""
    return cfg.grpo.steps_per_generation * cfg.grpo.iterations
