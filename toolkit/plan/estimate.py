"""`ftkit plan`: what a fine-tune needs per GPU under each backend, which one to launch, and what it costs,
from the model's config alone (know before you rent)."""

from __future__ import annotations

import dataclasses
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from toolkit.config import LossConfig, LossHead, Method, RecipeConfig, load_any_recipe_config
from toolkit.errors import UserError
from toolkit.fields import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Probability,
    Range,
    field_errors,
)
from toolkit.grpo.config import GrpoConfig, GrpoRecipeConfig
from toolkit.launch.machine import GIB
from toolkit.model import flops
from toolkit.plan import (
    GradCkpt,
    Objective,
    PlanDtype,
    PlanPrecision,
    architectures,
    comm,
    generation,
    memory,
    parallel,
    pipeline,
)
from toolkit.plan.counts import ModelCounts, count_parameters, load_model_config
from toolkit.plan.memory import Head, MemoryEstimate, Precision
from toolkit.preference.config import PreferenceConfig
from toolkit.train.metrics import read_metrics
from toolkit.typed_yaml import dotted, to_dict

RECIPES = {"sft": "finetune_llm.py", "dpo": "dpo_llm.py", "grpo": "grpo_llm.py"}
# The printed command runs from a checkout's root, so its recipe configs are looked up from there too.
RECIPE_CONFIGS = Path("recipes") / "configs"
# Fastest first. Gradient checkpointing costs about a third more compute; ZeRO-1/2 move no more data than
# DDP, while ZeRO-3/FSDP gather every weight twice a step and offload crosses PCIe every step.
MULTI_GPU_TIERS = (("ddp", "zero1", "zero2"), ("fsdp", "zero3"), ("zero3_offload",))
SINGLE_GPU_TIERS = (("single",), ("zero3_offload",))


@dataclass(frozen=True)
class PlanRequest:
    model: str
    """Local model dir, config.json path, or hub id (built-in table or local cache)."""
    gpus: PositiveInt = 1
    """GPUs on the machine (one process each)."""
    gpu_mem: PositiveFloat = 24.0
    """Memory of one GPU in GiB (a "24 GB" RTX 4090 has 24 GiB)."""
    method: Method = "lora"
    """How the model is fine-tuned, as the recipe's model.method."""
    seq_len: PositiveInt = 2048
    """Tokens per example (data.max_length); under grpo a prompt's, before its completion."""
    micro_batch: PositiveInt | None = None
    """Examples per forward pass per GPU; None: the largest that fits."""
    global_batch: PositiveInt = 32
    """Examples per optimizer step across all GPUs."""
    lora_r: PositiveInt = 16
    """LoRA rank (adapters on every linear layer)."""
    lora_dropout: Probability = 0.0
    """LoRA dropout; above 0 it stores a dropped copy of every adapted input."""
    grad_ckpt: GradCkpt = "auto"
    """Gradient checkpointing (auto: try off, then on)."""
    dtype: PlanDtype = "auto"
    """Weights dtype (auto: bfloat16 for LoRA/QLoRA, float32 for full, as recipes)."""
    mixed_precision: PlanPrecision = "bf16"
    """Autocast."""
    cpu_mem: NonNegativeFloat | None = None
    """CPU RAM of the machine in GiB; when set, setups needing more do not fit."""
    objective: Objective = "sft"
    """What is trained: sft; dpo (preference tuning: two sequences, chosen and rejected, per example); grpo
    (online RL: a round generates completions, then training reads prompt + completion rows)."""
    reference_model: bool = False
    """dpo or grpo with a separate reference model: its frozen weights too (none with LoRA's adapter off or
    precomputed reference log-probs)."""
    loss_head: LossHead = LossConfig.head
    """How the loss reads the output head (loss.head; chunked: the logits never exist whole)."""
    chunk_tokens: PositiveInt = LossConfig.chunk_tokens
    """Label tokens per chunk of the chunked head (loss.chunk_tokens)."""
    generations: Annotated[int, Range(low=2)] = GrpoConfig.num_generations
    """grpo: completions sampled per prompt (grpo.num_generations)."""
    max_new_tokens: PositiveInt = GrpoConfig.max_new_tokens
    """grpo: tokens a completion may have, after its prompt (grpo.max_new_tokens)."""
    generation_batch: NonNegativeInt = GrpoConfig.generation_batch_size
    """grpo: completions a GPU generates at once (grpo.generation_batch_size; 0: its share of a round)."""
    steps_per_generation: PositiveInt = GrpoConfig.steps_per_generation
    """grpo: optimizer steps one round feeds (grpo.steps_per_generation)."""
    gather_for_generation: bool = GrpoConfig.gather_for_generation
    """grpo: under ZeRO-3/FSDP the whole model is gathered on each GPU to generate."""
    beta: NonNegativeFloat = GrpoConfig.beta
    """grpo: KL weight (grpo.beta); above 0 a reference is scored (LoRA's adapter off costs nothing)."""

    def validate(self) -> None:
        errors = field_errors(self)
        if errors:
            name, _, message = errors[0].partition(": ")
            raise UserError(f"--{_flag(name)} {message}")
        if self.reference_model and self.objective == "sft":
            raise UserError("--reference-model is for --objective dpo or grpo")
        per_step = (self.micro_batch or 1) * self.gpus
        if self.global_batch % per_step:
            raise UserError(
                f"--global-batch {self.global_batch} is not a multiple of micro-batch x GPUs ({per_step})"
            )
        if self.objective == "grpo":
            self._validate_grpo()
            return
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        changed = [name for name in GRPO_OPTIONS if getattr(self, name) != defaults[name]]
        if changed:
            raise UserError(f"--{_flag(changed[0])} is for --objective grpo")

    def _validate_grpo(self) -> None:
        """What the GRPO recipe would refuse (toolkit/grpo/config.py), in the plan's words."""
        completions = self.global_batch * self.steps_per_generation
        if completions % self.generations:
            raise UserError(
                f"--global-batch x --steps-per-generation ({completions}) must be a multiple of "
                f"--generations ({self.generations}): a round generates whole groups"
            )
        if self.reference_model and self.beta == 0:
            raise UserError("--reference-model with --objective grpo needs --beta > 0 (at 0 none is loaded)")
        if self.beta > 0 and self.method == "full" and not self.reference_model:
            raise UserError("--objective grpo --method full with --beta > 0 needs --reference-model")

    @property
    def rows_per_example(self) -> int:
        """Sequences one example puts through the model: chosen and rejected under dpo."""
        return 2 if self.objective == "dpo" else 1

    @property
    def row_tokens(self) -> int:
        """Tokens of one trained sequence: under grpo a prompt and its completion."""
        return self.seq_len + (self.max_new_tokens if self.objective == "grpo" else 0)

    @property
    def head(self) -> Head:
        """The loss head; dpo and grpo read per-token log-probs of the labels."""
        return Head(self.loss_head, self.chunk_tokens, log_probs=self.objective != "sft")

    def generation_round(self) -> generation.Round | None:
        """GRPO's round (None for the other objectives)."""
        if self.objective != "grpo":
            return None
        return generation.Round(
            completions=self.global_batch * self.steps_per_generation,
            batch=self.generation_batch,
            prompt_tokens=self.seq_len,
            new_tokens=self.max_new_tokens,
            gather=self.gather_for_generation,
        )


GRPO_OPTIONS = (
    "generations",
    "max_new_tokens",
    "generation_batch",
    "steps_per_generation",
    "gather_for_generation",
    "beta",
)
"""The options only --objective grpo reads."""


def _flag(name: str) -> str:
    return name.replace("_", "-")


@dataclass(frozen=True)
class CostRequest:
    tokens: int
    """Tokens to train on (all epochs)."""
    tokens_per_s: float | None = None
    """Measured throughput of the whole machine."""
    from_run: str | None = None
    """Output dir of a run on the same hardware: its metrics.jsonl gives tokens_per_s."""
    price_per_gpu_hour: float | None = None


@dataclass(frozen=True)
class Cost:
    tokens: int
    tokens_per_s: float
    throughput_source: str
    wall_hours: float
    gpu_hours: float
    price_per_gpu_hour: float | None
    price: float | None
    """Total price (None without --price-per-gpu-hour)."""


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    counts: ModelCounts
    precision: Precision
    rows: list[MemoryEstimate]
    choice: MemoryEstimate | None
    """The recommended setup, None when nothing fits."""
    command: str | None
    flops_per_token: int
    cost: Cost | None
    full_head: MemoryEstimate | None = None
    """The recommended setup with the full logits instead of the chunked head (None under loss.head full)."""
    layouts: tuple[parallel.Layout, ...] = ()
    """The model-parallel layouts (tp, fsdp_tp, hsdp, then the pipelines pp and pp_ddp) on more than one GPU,
    at the rows' micro-batch."""
    comm: dict[str, int] = dataclasses.field(default_factory=dict)
    """Bytes each GPU sends per optimizer step under each data-parallel backend, at the rows' micro-batch."""

    def fits(self, row: MemoryEstimate) -> bool:
        return fits(row, self.request)

    def grad_accum(self, row: MemoryEstimate) -> int:
        return self.request.global_batch // (row.micro_batch * processes(row.backend, self.request.gpus))


def requests_from_options(options: dict) -> tuple[PlanRequest, CostRequest | None]:
    """Requests from parsed command-line options; options left out take the dataclass defaults."""
    names = {f.name for f in dataclasses.fields(PlanRequest)}
    request = PlanRequest(**{k: v for k, v in options.items() if k in names and v is not None})
    cost_options = ("tokens_per_s", "from_run", "price_per_gpu_hour")
    if options.get("tokens") is None:
        given = [k for k in cost_options if options.get(k) is not None]
        if given:
            raise UserError(f"--{given[0].replace('_', '-')} needs --tokens N (how many tokens to train on)")
        return request, None
    return request, CostRequest(int(options["tokens"]), *(options.get(k) for k in cost_options))


def make_plan(request: PlanRequest, cost: CostRequest | None = None) -> Plan:
    """Count the model, estimate every backend, and pick the fastest setup that fits."""
    request.validate()
    config, source = load_model_config(request.model)
    counts = count_parameters(config, request.method, request.lora_r, source)
    precision = resolve_precision(request)
    micro = request.micro_batch or 1
    backends = [b for tier in tiers(request.gpus) for b in tier] if request.gpus == 1 else memory.BACKENDS
    rows = [
        _estimate(counts, request, precision, b, ckpt, micro)
        for b in backends
        for ckpt in _ckpt_options(request)
    ]
    choice = recommend(counts, request, precision)
    return Plan(
        request=request,
        counts=counts,
        precision=precision,
        rows=rows,
        choice=choice,
        command=launch_line(choice, request, precision) if choice else None,
        flops_per_token=flops.flops_per_token(counts, request.row_tokens),
        cost=estimate_cost(cost, request.gpus) if cost else None,
        full_head=_with_full_head(choice, counts, request, precision),
        layouts=parallel.layouts(counts, request, precision, _ckpt_options(request), micro)
        + pipeline.layouts(config, counts, request, precision, _ckpt_options(request), micro),
        comm=_data_parallel_comm(counts, request, precision, micro),
    )


def _data_parallel_comm(counts, request: PlanRequest, precision, micro: int) -> dict[str, int]:
    if request.gpus == 1:
        return {}
    micro_batches = request.global_batch // (micro * request.gpus)
    return {
        backend: comm.data_parallel_bytes(counts, backend, request.gpus, micro_batches, precision)
        for backend in memory.BACKENDS
        if backend != "single"
    }


def _with_full_head(
    row: MemoryEstimate | None, counts, request: PlanRequest, precision
) -> MemoryEstimate | None:
    """`row` as it would be with the full logits, to tell what fits only thanks to the chunked head."""
    if row is None or request.loss_head == "full":
        return None
    full = dataclasses.replace(request, loss_head="full")
    return _estimate(counts, full, precision, row.backend, row.checkpointing, row.micro_batch)


def resolve_precision(request: PlanRequest) -> Precision:
    """The weights dtype and autocast the recipe would use (the shipped recipe configs' choice for auto)."""
    weights = request.dtype
    if weights == "auto":
        weights = "float32" if request.method == "full" else "bfloat16"
    return Precision(weights=weights, mixed=request.mixed_precision)


def tiers(gpus: int) -> tuple[tuple[str, ...], ...]:
    return SINGLE_GPU_TIERS if gpus == 1 else MULTI_GPU_TIERS


def processes(backend: str, gpus: int) -> int:
    return 1 if backend == "single" else gpus


def fits(row: MemoryEstimate, request: PlanRequest) -> bool:
    in_gpu = row.per_gpu()["total"] <= request.gpu_mem * GIB
    return in_gpu and (request.cpu_mem is None or row.cpu_ram <= request.cpu_mem * GIB)


def recommend(counts: ModelCounts, request: PlanRequest, precision: Precision) -> MemoryEstimate | None:
    """The first fitting setup, fastest tier first and checkpointing off before on within a tier; then the
    micro-batch doubles while it fits and divides the per-GPU batch (unless --micro-batch fixed it)."""
    for tier in tiers(request.gpus):
        for ckpt in _ckpt_options(request):
            for backend in tier:
                row = _estimate(counts, request, precision, backend, ckpt, request.micro_batch or 1)
                if fits(row, request):
                    return row if request.micro_batch else _grow_micro_batch(row, counts, request, precision)
    return None


def _grow_micro_batch(row: MemoryEstimate, counts, request: PlanRequest, precision) -> MemoryEstimate:
    per_gpu_batch = request.global_batch // processes(row.backend, request.gpus)
    while per_gpu_batch % (row.micro_batch * 2) == 0:
        bigger = _estimate(counts, request, precision, row.backend, row.checkpointing, row.micro_batch * 2)
        if not fits(bigger, request):
            break
        row = bigger
    return row


def _estimate(
    counts, request: PlanRequest, precision, backend: str, ckpt: bool, micro: int
) -> MemoryEstimate:
    reference = reference_bytes(counts, request, precision, backend)
    row = memory.estimate(
        counts,
        backend,
        request.gpus,
        request.row_tokens,
        micro,
        ckpt,
        precision,
        request.lora_dropout,
        sequences_per_example=request.rows_per_example,
        reference=reference,
        head=request.head,
    )
    plan_round = request.generation_round()
    if plan_round is None:
        return row
    data_parallel = processes(backend, request.gpus)
    phase = generation.estimate(
        counts, backend, request.gpus, row.states, precision, plan_round, reference, data_parallel
    )
    return dataclasses.replace(row, generation=phase)


def reference_bytes(counts, request: PlanRequest, precision: Precision, backend: str) -> int:
    """A separate reference model's weights per GPU: the model whole, sharded like the policy under
    FSDP/ZeRO-3."""
    if not request.reference_model:
        return 0
    whole = counts.total * (4 if precision.weights == "float32" else 2)
    return whole // request.gpus if backend in ("fsdp", "zero3", "zero3_offload") else whole


def _ckpt_options(request: PlanRequest) -> tuple[bool, ...]:
    return {"auto": (False, True), "on": (True,), "off": (False,)}[request.grad_ckpt]


def launch_line(row: MemoryEstimate, request: PlanRequest, precision: Precision) -> str | None:
    """The exact `accelerate launch` line: a shipped recipe config plus the overrides this plan assumed."""
    template = _template_config(request.model, request.method, request.objective)
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
    if request.objective == "grpo":
        wanted |= {
            "grpo.num_generations": request.generations,
            "grpo.max_new_tokens": request.max_new_tokens,
            "grpo.generation_batch_size": request.generation_batch,
            "grpo.steps_per_generation": request.steps_per_generation,
            "grpo.gather_for_generation": request.gather_for_generation,
            "grpo.beta": request.beta,
        }
    overrides = [f"{key}={_yaml_value(value)}" for key, value in wanted.items() if current[key] != value]
    overrides.append(f"train.micro_batch_size={row.micro_batch}")
    procs = "" if row.backend == "single" else f" --num_processes {request.gpus}"
    return (
        f"accelerate launch --config_file accelerate_configs/{row.backend}.yaml{procs} "
        f"recipes/{RECIPES[request.objective]} --config {path} "
        + " ".join(shlex.quote(item) for item in overrides)
    )


def _template_config(model: str, method: str, objective: str = "sft") -> tuple[str, dict] | None:
    """The shipped recipe config closest to this run: same method first, then same model, then same shapes
    (among the configs of the objective's recipe, as their sections tell)."""
    loaded = {path: load_any_recipe_config(path) for path in sorted(RECIPE_CONFIGS.glob("*.yaml"))}
    configs = {path: cfg for path, cfg in loaded.items() if _objective_of(cfg) == objective}
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
            path.name != "demo.yaml",
        )

    best = max(configs, key=closeness)
    return str(best), dotted(to_dict(configs[best]))


def _objective_of(cfg: RecipeConfig) -> str:
    if isinstance(cfg, PreferenceConfig):
        return "dpo"
    return "grpo" if isinstance(cfg, GrpoRecipeConfig) else "sft"


def _yaml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def estimate_cost(cost: CostRequest, gpus: int) -> Cost:
    """Wall time, GPU-hours and price of training on `cost.tokens` at a given or measured throughput."""
    if cost.tokens <= 0:
        raise UserError(f"--tokens must be positive, got {cost.tokens}")
    if cost.tokens_per_s is not None:
        rate, source = cost.tokens_per_s, "--tokens-per-s"
    elif cost.from_run is not None:
        rate, source = measured_tokens_per_s(Path(cost.from_run)), f"median of {cost.from_run}/metrics.jsonl"
    else:
        raise UserError("--tokens needs a throughput: --tokens-per-s X or --from-run OUTPUT_DIR")
    if rate <= 0:
        raise UserError(f"tokens per second must be positive, got {rate}")
    wall_hours = cost.tokens / rate / 3600
    gpu_hours = wall_hours * gpus
    price = gpu_hours * cost.price_per_gpu_hour if cost.price_per_gpu_hour is not None else None
    return Cost(cost.tokens, rate, source, wall_hours, gpu_hours, cost.price_per_gpu_hour, price)


def measured_tokens_per_s(run_dir: Path) -> float:
    """Median tokens_per_s of a run's logged steps; the first step (allocation, warm-up) is left out."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"--from-run {run_dir}: no metrics.jsonl there")
    rates = [r["tokens_per_s"] for r in read_metrics(path) if isinstance(r.get("tokens_per_s"), (int, float))]
    if not rates:
        raise UserError(f"{path}: no tokens_per_s logged yet")
    return statistics.median(rates[1:] or rates)
