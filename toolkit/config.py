"""The typed recipe config: every key, its default and its meaning live here and nowhere else. How YAML
becomes these dataclasses (types, unknown keys, overrides) is toolkit/typed_yaml.py's generic business."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import yaml

from toolkit.errors import UserError
from toolkit.fields import (
    Fraction,
    Length,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Probability,
    Range,
    field_problems,
)
from toolkit.typed_yaml import Sources, build, read_yaml_mapping, set_dotted

# Package data, so `load_config(None)` works from any install; recipes/configs/demo.yaml is its twin.
DEMO_CONFIG = Path(__file__).resolve().parent / "assets" / "demo.yaml"

# The words a key accepts, declared once: the config check, the command line and the docs read them here.
Method = Literal["full", "lora", "qlora"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
Dtype = Literal["float32", "bfloat16", "float16", "auto"]
QuantStorage = Literal["auto", "float32", "bfloat16", "float16"]
Attention = Literal["auto", "sdpa", "eager", "flash_attention_2", "flex_attention"]
ExpertsKernel = Literal["auto", "grouped_mm", "batched_mm", "eager"]
Switch = bool | Literal["auto"]
DataFormat = Literal["auto", "messages", "sharegpt", "alpaca", "text", "prompt_completion"]
LrScaling = Literal["none", "linear", "sqrt"]
LrScheduler = Literal["cosine", "linear", "constant"]
MixedPrecision = Literal["no", "bf16", "fp16"]
OnNonFinite = Literal["skip", "stop"]
Tracker = Literal["tensorboard", "wandb", "mlflow", "trackio"]
LossHead = Literal["auto", "chunked", "full"]
Seed = Annotated[int, Range(low=0, high=2**32 - 1)]


@dataclass
class ModelConfig:
    path: str = "toolkit/assets/tiny-llama"
    """Local directory or hub id of the base model (anything `from_pretrained` accepts)."""
    method: Method = "lora"
    """How to fine-tune (qlora: LoRA over a 4-bit NF4 base via bitsandbytes, on GPU or CPU)."""
    dtype: Dtype = "float32"
    """Dtype the weights are loaded in (auto: as the model's config says)."""
    attn_implementation: Attention = "auto"
    """Attention kernel (auto: flex_attention for packed rows on CUDA, else sdpa; flash_attention_2 needs
    CUDA + flash-attn, flex_attention CUDA, else sdpa with a note)."""
    gradient_checkpointing: Switch = "auto"
    """Recompute activations in the backward pass to save memory (auto: on for LoRA/QLoRA of models with
    1B+ parameters)."""
    liger_kernels: bool = False
    """Liger's Triton kernels for norms, rotary embedding and MLP (CUDA + liger-kernel, else a note)."""
    compile: Switch = "auto"
    """torch.compile each decoder block, in place (checkpoint and export names are unchanged); auto: on
    CUDA for one process, DDP and FSDP with LoRA or full fine-tuning, off on CPU where it does not pay."""
    compile_cache: str = ""
    """Where compiled code is kept for the next start of a compiled run: "" the run's own
    output_dir/compile-cache, a folder to share between runs of the same shapes, or "off"."""
    trust_remote_code: bool = False
    """Allow modelling code shipped with the checkpoint to run."""
    quant_storage: QuantStorage = "auto"
    """QLoRA: the dtype 4-bit weights are packed into (auto: the dtype FSDP2 or DeepSpeed cast parameters to
    under mixed precision, so the cast leaves them intact; float32 elsewhere)."""
    adapter: str | None = None
    """LoRA adapter directory (e.g. an SFT run's final/) merged into the base before training starts."""


@dataclass
class LoraConfig:
    r: PositiveInt = 16
    """Rank of the low-rank update."""
    alpha: PositiveInt = 32
    """Scaling numerator: the update is multiplied by alpha / r."""
    dropout: Probability = 0.0
    """Dropout on the LoRA input."""
    target_modules: str | list[str] = "all-linear"
    """Module names to adapt, or "all-linear" for every linear layer but the output head."""
    use_dora: bool = False
    """Weight-decomposed LoRA (DoRA)."""
    experts: bool = True
    """Mixture of experts: adapt the routed experts (their fused 3-D tensors, which no module name reaches
    on every family). The four part keys have no effect on a dense model."""
    router: bool = False
    """Mixture of experts: adapt the routers' weights. Off by default: the router decides which experts see
    each token, and a small fine-tuning set can undo the balance pretraining gave it."""
    shared_expert: bool = True
    """Mixture of experts: adapt the shared expert every token also goes through (Qwen2-MoE, Granite-MoE
    shared), where target_modules names its linear layers."""
    attention: bool = True
    """Mixture of experts: adapt the attention projections, where target_modules names them."""
    init_adapter: str | None = None
    """A saved LoRA adapter directory the trained adapter starts from, instead of fresh random weights: its
    layers, rank and alpha (with any per-layer alpha_pattern) are the adapter's own, and lora.r and
    lora.alpha must equal them. Unlike model.adapter, nothing is merged: that adapter trains on."""


@dataclass
class VisionConfig:
    """What trains in a vision-language model besides the language model, and how large images may be.
    Read only for a model with a vision tower (model/vision.py)."""

    train_projector: bool = False
    """Train the projector that maps the tower's features into the language model (LoRA: saved whole)."""
    train_tower: bool = False
    """Train the vision tower too (LoRA: adapters on its blocks' linear layers; full: its weights)."""
    tower_blocks: NonNegativeInt = 0
    """With train_tower, train only the tower's last this many blocks (0: all of them)."""
    tower_learning_rate: PositiveFloat | None = None
    """The tower's peak learning rate (None: train.learning_rate); scheduled like the rest."""
    max_pixels: PositiveInt | None = 589_824
    """Images larger than this many pixels are scaled down first (aspect kept), so a 4k screenshot cannot
    blow a row up (768 x 768 by default); None: as given (the family's own processor still resizes)."""


@dataclass
class DataConfig:
    train: str | list[str] = "toolkit/assets/demo/train.jsonl"
    """Training data: a file (jsonl/json/parquet/csv), a hub dataset id, or a list of them."""
    weights: list[NonNegativeFloat] | None = None
    """Mixture weights, one per `train` entry (relative; default: each source used once)."""
    format: DataFormat = "auto"
    """Record layout of the data (auto: detected from the first record)."""
    eval: str | None = None
    """Held-out data file or hub id; when unset, `eval_fraction` of train is held out."""
    eval_fraction: Probability = 0.05
    """Share of the training data held out for eval when `eval` is unset (0 disables eval)."""
    max_length: PositiveInt = 512
    """Tokens per example; longer examples are truncated (and counted in a warning)."""
    assistant_only_loss: bool = True
    """Train on assistant tokens only; false trains on every token of the conversation."""
    train_reasoning: bool = True
    """With assistant_only_loss, train assistant reasoning (reasoning_content) too; false leaves it out."""
    split: str = "train"
    """Split to read from hub datasets."""
    num_workers: NonNegativeInt = 0
    """DataLoader worker processes."""
    num_proc: NonNegativeInt = 0
    """Processes encoding the data (0: the cores this process may use, at most 8); same rows either way."""
    packing: bool = False
    """Pack examples into rows of max_length tokens (no attention across examples); batch sizes count rows."""
    group_by_length: bool = False
    """Without packing: fill each global batch with examples of similar length, so micro-batches pad less."""
    streaming: bool = False
    """Read, encode and pack the training data as training goes (no cache): for corpora larger than RAM."""


@dataclass
class TrainConfig:
    max_steps: PositiveInt = 100
    """Optimizer steps to run."""
    global_batch_size: PositiveInt = 16
    """Examples per optimizer step across all processes; accumulation is derived from it."""
    micro_batch_size: PositiveInt = 4
    """Examples per forward pass on one process."""
    learning_rate: PositiveFloat = 2e-4
    """Peak learning rate (before any scaling rule)."""
    lr_scaling: LrScaling = "none"
    """Scale the learning rate by world size (linear: x N processes, sqrt: x sqrt(N))."""
    lr_scheduler: LrScheduler = "cosine"
    """Schedule after warmup."""
    warmup_steps: NonNegativeInt = 0
    """Linear warmup steps."""
    min_lr_ratio: Fraction = 0.0
    """Floor of the decayed learning rate, as a fraction of the peak."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW weight decay (never applied to biases and norm weights)."""
    fused_adamw: Switch = "auto"
    """torch's fused AdamW kernel (auto: on CUDA; true: a note where unavailable)."""
    activation_offload: bool = False
    """Keep the activations each micro-batch saves for backward in CPU memory (pinned on GPUs) until backward
    needs them: the same gradients, less accelerator memory, more host traffic (toolkit/train/offload.py)."""
    adam_betas: Annotated[list[Probability], Length(2)] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    max_grad_norm: NonNegativeFloat = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    mixed_precision: MixedPrecision = "no"
    """Autocast precision."""
    log_every_steps: PositiveInt = 1
    """Write a metrics line every N optimizer steps."""
    eval_every_steps: NonNegativeInt = 0
    """Evaluate every N steps (0: only before and after training)."""
    save_every_steps: NonNegativeInt = 0
    """Checkpoint every N steps (0: only the final checkpoint)."""
    save_every_minutes: NonNegativeFloat = 0.0
    """Also checkpoint when this many minutes passed since the last one (0: off)."""
    keep_last: NonNegativeInt = 0
    """Keep only the K newest checkpoints (0: keep all; the newest is never deleted)."""
    keep_best: bool = False
    """Also keep the checkpoint with the lowest eval loss when pruning."""
    nonfinite: OnNonFinite = "stop"
    """On a NaN/inf loss or gradient norm: skip (drop the step, count it) or stop (see below)."""
    nonfinite_patience: PositiveInt = 3
    """Non-finite steps in a row before `stop` ends the run (earlier ones are skipped)."""
    stall_timeout_minutes: PositiveFloat = 15.0
    """No step, eval batch or checkpoint write for this long ends the run: stacks in output_dir/stall/,
    exit 124. A collective (all-reduce, barrier) fails after twice this long instead of hanging."""
    resume: str = "auto"
    """auto (newest checkpoint in output_dir) | never | path to a checkpoint directory."""
    overwrite: bool = False
    """Allow starting fresh in an output_dir that holds another run."""


@dataclass
class MoeConfig:
    router_aux_loss_coef: NonNegativeFloat | None = None
    """Weight of the routers' load-balancing loss for a mixture of experts (0: off); unset: the model
    config's router_aux_loss_coef, else 0.001. Pooled over the data-parallel ranks (train/router.py)."""
    expert_parallel: PositiveInt = 1
    """Processes a mixture of experts' routed experts are split over (all the launched ones, on a plain
    multi-process launch: accelerate_configs/ep.yaml); 1: every process holds every expert."""
    experts_implementation: ExpertsKernel = "auto"
    """How the routed experts compute (transformers' kernels): grouped_mm (one grouped matrix multiply for
    all experts), batched_mm (each token's experts' weights gathered: for a few tokens, memory-hungry),
    eager (a loop over experts); auto: transformers' choice, grouped_mm where torch can run it, else eager."""


@dataclass
class LossConfig:
    head: LossHead = "auto"
    """How the output head scores target tokens: chunked (log-probs of the label tokens only, a chunk of
    tokens at a time: the whole logits and their gradient never exist) or full (the model's own logits);
    auto: chunked where the chunked head reproduces the model's logits, else full (one note says why). The
    loss is the same either way."""
    chunk_tokens: PositiveInt = 512
    """Label tokens per chunk of the chunked head: a chunk holds chunk_tokens x vocabulary float32 logits."""


@dataclass
class PipelineConfig:
    size: PositiveInt = 1
    """Processes one pipeline spans, each holding consecutive decoder layers (1: no pipeline); the launch's
    processes divided by this are the data-parallel replicas (accelerate_configs/pp.yaml, pp_ddp.yaml)."""
    schedule: PipelineSchedule = "1f1b"
    """Order of the micro-batches' forward and backward passes: gpipe (all forwards, then all backwards),
    1f1b (one forward, one backward: fewer activations held) or interleaved_1f1b (a smaller bubble)."""
    chunks_per_process: PositiveInt = 1
    """Model chunks (stages) each process holds; interleaved_1f1b needs 2 or more, the others 1."""
    layers: list[PositiveInt] = field(default_factory=list)
    """Decoder layers of each stage, first to last (size x chunks_per_process numbers); empty: balanced
    by parameter count."""


@dataclass
class EvalConfig:
    max_batches: NonNegativeInt = 0
    """Cap on eval micro-batches per evaluation (0: the whole eval set)."""
    exact_match_samples: NonNegativeInt = 0
    """Greedy-decode this many eval examples and report exact-match accuracy (0 disables)."""
    sample_prompt: str = ""
    """Prompt shown with the model's answer before and after training ("" uses the first eval example)."""
    max_new_tokens: PositiveInt = 32
    """Generation length for samples and exact match."""
    benchmarks: list[str] = field(default_factory=list)
    """lm-eval tasks (docs/eval.md) scored before training, at each evaluation and after, logged as
    bench/<task>/<metric>; one process or DDP (the main process scores its whole copy of the model)."""
    benchmark_limit: PositiveInt | None = 50
    """Examples per benchmark task at each evaluation (None: all)."""


@dataclass
class ExportConfig:
    merge: bool = False
    """Also write a standalone model with the LoRA update merged in (final/merged)."""
    dtype: Dtype = "auto"
    """Dtype of exported weights (auto: as trained)."""


@dataclass
class LogConfig:
    trackers: list[Tracker] = field(default_factory=list)
    """Accelerate trackers to report to (the `trackers` extra installs them)."""
    project: str = "ftkit"
    """Project (experiment) name for trackers."""


@dataclass
class RecipeConfig:
    output_dir: str = "runs/demo"
    """Where config.yaml, metrics.jsonl, checkpoints/ and final/ are written."""
    seed: Seed = 42
    """Seed for weights of new modules, data order and dropout."""
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    log: LogConfig = field(default_factory=LogConfig)


def load_config(
    path: str | Path | None = None, overrides: list[str] = (), schema: type[RecipeConfig] = RecipeConfig
) -> RecipeConfig:
    """Read a YAML recipe config (the demo when `path` is None) and apply `key=value` overrides.

    `schema` is the recipe's config class: RecipeConfig or a subclass adding sections of its own."""
    path = Path(path) if path else DEMO_CONFIG
    raw = read_yaml_mapping(path, "config file")
    overridden = set()
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"override {item!r} must look like key=value (e.g. train.max_steps=50)")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            reason = str(exc).splitlines()[0]
            raise UserError(f"override {item!r}: the value is not YAML ({reason}); quote it") from exc
        set_dotted(raw, key.strip(), parsed, source="command line")
        overridden.add(key.strip())
    sources = Sources(str(path), frozenset(overridden))
    cfg = build(schema, raw, prefix="", sources=sources)
    validate(cfg, sources)
    return cfg


def validate(cfg: RecipeConfig, sources: Sources) -> None:
    """Check every key against the values its field declares, then what single fields cannot express;
    `sources` tells which of the file and the command line set a refused key."""
    problems = field_problems(cfg)
    if problems:
        key, why = problems[0]
        raise UserError(f"{sources.of(key)}: {key}: {why}")
    if cfg.train.global_batch_size % cfg.train.micro_batch_size:
        raise UserError(
            f"train.global_batch_size ({cfg.train.global_batch_size}) is not a multiple of "
            f"train.micro_batch_size ({cfg.train.micro_batch_size})"
        )
    if cfg.lora.init_adapter and cfg.model.method == "full":
        raise UserError(
            f"{sources.of('lora.init_adapter')}: lora.init_adapter: a full fine-tune trains no adapter; "
            "use model.method lora or qlora"
        )
    data = cfg.data.train if isinstance(cfg.data.train, list) else [cfg.data.train]
    if cfg.data.weights is not None and len(cfg.data.weights) != len(data):
        raise UserError(f"data.weights: {len(cfg.data.weights)} weights for {len(data)} data.train sources")
    if cfg.data.packing and cfg.data.group_by_length:
        raise UserError("data.group_by_length has no effect with data.packing; set only one")
    if cfg.model.adapter and cfg.model.method == "qlora":
        raise UserError("model.adapter cannot be merged into a 4-bit base; use model.method lora or full")


def check_init_adapter(lora: LoraConfig | None) -> None:
    """lora.init_adapter where set, before a run writes anything: an adapter folder whose rank, alpha and
    DoRA are the config's (read from its adapter_config.json; its weights load with the model)."""
    if not (lora and lora.init_adapter):
        return
    where = lora.init_adapter
    settings = Path(where) / "adapter_config.json"
    if not settings.is_file():
        raise UserError(f"lora.init_adapter: {where} is not an adapter directory (no adapter_config.json)")
    saved = json.loads(settings.read_text())
    pairs = (("r", lora.r, saved.get("r")), ("alpha", lora.alpha, saved.get("lora_alpha")))
    for key, ours, theirs in (*pairs, ("use_dora", lora.use_dora, bool(saved.get("use_dora")))):
        if ours != theirs:
            raise UserError(f"lora.{key} is {ours}, the adapter at lora.init_adapter ({where}) has {theirs}")


def check_start_folders(cfg) -> None:
    """A run's model and adapter folders exist (a run it comes from may not be trained yet, and a missing one
    would be asked of the hub), and an adapter it continues fits its lora section."""
    for key in ("path", "adapter"):
        if getattr(cfg.model, key):
            check_local_path(getattr(cfg.model, key), f"model.{key}")
    check_init_adapter(getattr(cfg, "lora", None))


def check_local_path(path: str, key: str) -> None:
    """Fail early on a local-looking path that does not exist, rather than asking the hub for it."""
    looks_local = path.startswith((".", "/", "~")) or path.count("/") >= 2
    if looks_local and not Path(path).expanduser().exists():
        raise UserError(f"{key}: {path} does not exist")
