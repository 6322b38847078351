"""Load the tokenizer and the model to train: full weights, LoRA/DoRA, or QLoRA on a 4-bit base."""

from __future__ import annotations

import math
import os
import traceback
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoTokenizer
from transformers.integrations import is_deepspeed_zero3_enabled

from toolkit import console
from toolkit.config import (
    LoraConfig,
    LossConfig,
    ModelConfig,
    MoeConfig,
    VisionConfig,
    check_init_adapter,
    check_local_path,
)
from toolkit.errors import UserError
from toolkit.model import backbone, expert_parallel, lora_targets, moe, quant, scalar, speed, vision
from toolkit.model.speed import SpeedFeatures
from toolkit.train import head

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def load_tokenizer(cfg: ModelConfig):
    """The model's tokenizer, with a pad token (the eos token when the model has none)."""
    check_local_path(cfg.path, "model.path")
    return with_pad_token(_from_pretrained(AutoTokenizer, cfg, "tokenizer"))


def model_class(path: str, scalar_head: bool = False, bare: bool = False):
    """transformers' auto class for the model at `path`: the bare model for `bare` (asked for, or the
    folder's own: toolkit/model/backbone.py), sequence classification for a scalar head (asked for, or the
    folder's own: toolkit/model/scalar.py), image-text-to-text for a vision-language model (a family ftkit
    has not proven is refused by name), causal LM otherwise."""
    if bare or backbone.saved_bare(path):
        return backbone.auto_class()
    if scalar_head or scalar.saved_scalar(path):
        return scalar.auto_class()
    kind = vision.model_type(path)
    if vision.is_vision(kind):
        vision.check_family(kind, path)
    return vision.auto_class(kind)


def with_pad_token(tokenizer):
    """`tokenizer`, given the eos token as its pad token when the model has none (batches need one)."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


AUTO_CHECKPOINTING_PARAMS = 1_000_000_000
"""`gradient_checkpointing: auto` turns it on for adapters over a base this large: activations, not weights,
are then what fills the GPU."""


def load_model(
    cfg: ModelConfig,
    lora: LoraConfig,
    local_rank: int = 0,
    features: SpeedFeatures | None = None,
    key: str = "model.path",
    quant_cast: str | None = None,
    loss: LossConfig | None = None,
    experts: MoeConfig | None = None,
    parts: VisionConfig | None = None,
    scalar_head: bool = False,
    bare: bool = False,
    num_labels: int = 1,
):
    """The trainable model: everything trainable for `full`, only the adapter for `lora`/`qlora`.

    `features` (from `speed.resolve`) chooses the attention kernel, Liger kernels and compilation; `key`
    is the config key that errors about `cfg.path` name; `quant_cast` (QLoRA) is the dtype the backend
    casts parameters to (`quant.cast_dtype`), which auto storage packs 4-bit weights into; `loss` chooses
    the output head (the chunked head is installed for `loss.head: chunked`, and for auto where it
    reproduces the model's logits; none given: the model's own);
    `experts` (a mixture of experts' `moe` section) chooses the experts' kernel and splits them over
    `expert_parallel` processes; `parts` (the `vision` section) chooses what of a vision-language model
    trains besides its language model; `scalar_head`: a reward model's scalar head in place of the output
    layer (drawn from the run's seed unless the folder has one), trained whole beside LoRA, `num_labels`
    numbers wide (a classifier's); `bare`: the model without any head (its last hidden states: an
    embedding model's).
    """
    # Imported here, not with the module: it brings peft (seconds of imports), which loading a whole model
    # for `ftkit eval` or `ftkit generate` does not need.
    from toolkit.model import quant_experts

    check_local_path(cfg.path, key)
    # Without resolved features (no device to decide for), auto is the kernel every device has.
    attention = features.attention if features else cfg.attn_implementation.replace("auto", "sdpa")
    kind = vision.kind_of(cfg.path)
    kwargs = {"dtype": DTYPES[cfg.dtype], "attn_implementation": vision.attention_by_part(kind, attention)}
    if experts and experts.experts_implementation != "auto":
        kwargs["experts_implementation"] = experts.experts_implementation
    if cfg.method == "qlora":
        kwargs.update(_qlora_kwargs(cfg, local_rank, quant.storage_name(cfg.quant_storage, quant_cast)))
    if scalar_head:
        kwargs["num_labels"] = num_labels
    model = _from_pretrained(model_class(cfg.path, scalar_head, bare), cfg, "model", key, **kwargs)
    if scalar_head and not scalar.saved_scalar(cfg.path):
        scalar.seeded_head(model)
    seeing = vision.is_vision(getattr(model.config, "model_type", None))
    vision.keep_present_blocks(model)  # Qwen3.5's text model lists its vision blocks too
    if cfg.method == "qlora":
        quant.keep_training_layout(model)
    if cfg.adapter:
        model = merge_start_adapter(model, cfg.adapter)
    if cfg.method == "qlora":  # after the start adapter, merged into the experts at full width
        storage = quant.STORAGE_DTYPES[quant.storage_name(cfg.quant_storage, quant_cast)]
        quant_experts.quantize(model, storage, _gpu(local_rank))
    if experts and experts.expert_parallel > 1:
        expert_parallel.split_experts(model, experts.expert_parallel)
    if features and features.liger:
        speed.apply_liger(model)
    if seeing and cfg.method == "full":
        vision.freeze_for_full(model, parts or VisionConfig())
    checkpointing = wants_checkpointing(cfg, model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.method == "qlora":
        bf16 = quant.bf16_names(model)
        with quant_experts.hidden_from_peft(model):
            from peft import prepare_model_for_kbit_training

            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing)
        quant.keep_bf16_stream(model, bf16)
    if cfg.method in ("lora", "qlora"):
        with quant_experts.unquantized_look(model):
            model = _with_adapter(model, lora, (parts or VisionConfig()) if seeing else None)
        quant_experts.peft_wrappers_stack(model)
        if checkpointing:
            # Frozen embeddings give checkpointed blocks inputs without grad; the adapters need one.
            model.enable_input_require_grads()
    if loss is not None and loss.head != "full" and not (scalar_head or bare):
        _chunked_head(model, loss, fused=bool(features and features.compile))
    if features and features.compile:
        speed.compile_blocks(model)
    return model


def _chunked_head(model, loss: LossConfig, fused: bool = False) -> None:
    """The chunked head in place of the output layer; under `auto`, where it cannot reproduce the model's
    logits, the model's own head stays (the same loss), said once. `fused`: its per-chunk math compiled
    with the blocks."""
    reason = head.not_chunkable(model)
    if reason and loss.head == "auto":
        console.say_once(f"loss.head auto: full logits ({reason})")
        return
    head.install(model, loss.chunk_tokens, fused)


def merge_start_adapter(model, adapter: str):
    """The base with a trained adapter folded in: the starting point (and, for preference tuning, the
    reference) is then the adapted model, and a new adapter or a full fine-tune continues from it."""
    from peft import PeftModel

    if not (Path(adapter) / "adapter_config.json").is_file():
        raise UserError(f"model.adapter: {adapter} is not an adapter directory (no adapter_config.json)")
    wrapped = PeftModel.from_pretrained(model, adapter, **scalar.adapter_settings(model, adapter))
    merged = _merge_gathered(wrapped) if is_deepspeed_zero3_enabled() else wrapped.merge_and_unload()
    # Loading the adapter froze the base; a full fine-tune trains all of it (LoRA freezes it again).
    return merged.requires_grad_(True)


def _merge_gathered(wrapped):
    """peft's merge under ZeRO-3, whose base weights are already partitioned when the model is built: each
    adapted layer's weights are gathered whole, the adapter added in, and the sum partitioned again."""
    import deepspeed
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in wrapped.modules():
        if isinstance(module, BaseTunerLayer):
            whole = list(module.get_base_layer().parameters(recurse=False))
            with deepspeed.zero.GatheredParameters(whole, modifier_rank=0), torch.no_grad():
                module.merge()
    return wrapped.unload()


def wants_checkpointing(cfg: ModelConfig, model) -> bool:
    """The config's choice; `auto` is on for LoRA/QLoRA over a base of AUTO_CHECKPOINTING_PARAMS or more."""
    if cfg.gradient_checkpointing != "auto":
        return bool(cfg.gradient_checkpointing)
    return cfg.method != "full" and trainable_and_total(model)[1] >= AUTO_CHECKPOINTING_PARAMS


def trainable_and_total(model) -> tuple[int, int]:
    """(trainable, total) parameter counts; ZeRO-3 partitioned parameters and 4-bit ones count at their
    full size (their weights, not their packed bytes)."""
    sizes = [(_weights(p), p.requires_grad) for p in model.parameters()]
    return sum(n for n, trained in sizes if trained), sum(n for n, _ in sizes)


def _weights(param) -> int:
    return math.prod(moe.full_shape(param))


def peft_config(lora: LoraConfig, model, parts: VisionConfig | None = None):
    """The peft LoRA/DoRA settings for a recipe's `lora` section on `model` (on a mixture of experts, the
    parts its keys choose: lora_targets; on a vision-language model, the parts `parts` chooses)."""
    targets = vision.lora_targets(model, lora, parts) if parts else lora_targets.peft_targets(lora, model)
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        use_dora=lora.use_dora,
        task_type=backbone.PEFT_TASK if backbone.is_bare(model) else scalar.peft_task(model),
        **targets,
    )


def _with_adapter(model, lora: LoraConfig, parts: VisionConfig | None = None):
    from peft import get_peft_model

    # The adapters' random initial weights come from the run's seed, not from wherever loading the base
    # left the generator: building the model under ZeRO-3's zero.Init runs its modules' constructors on
    # real tensors, and some (Qwen3.5's and Qwen3-Next's linear attention) draw random numbers there that
    # a load onto the meta device does not, which would give each backend different adapters.
    torch.manual_seed(torch.initial_seed())
    if lora.init_adapter:
        return _continued_adapter(model, lora)
    try:
        return get_peft_model(model, peft_config(lora, model, parts))
    except ValueError as exc:  # peft's "target modules not found" and its kin
        raise UserError(f"lora.target_modules: {lora.target_modules}: {str(exc).splitlines()[0]}") from None


def _continued_adapter(model, lora: LoraConfig):
    """The saved adapter at lora.init_adapter, trainable: its own layers, rank and alpha (alpha_pattern
    too), which lora.r and lora.alpha must equal, so what the config says is what trains."""
    from peft import PeftModel

    check_init_adapter(lora)
    where = lora.init_adapter
    try:
        return PeftModel.from_pretrained(
            model, where, is_trainable=True, **scalar.adapter_settings(model, where)
        )
    except (ValueError, RuntimeError, KeyError) as exc:  # another model's layers, names or shapes
        raise UserError(f"lora.init_adapter: {where}: {str(exc).splitlines()[0]}") from None


def adapted_summary(wrapped) -> str:
    """One line naming what the adapters sit on: each kind of layer (by its last name) with how many of it,
    and the expert tensors adapted as parameters."""
    tuner = wrapped.base_model
    counts: dict[str, int] = {}
    for name in tuner.targeted_module_names:
        leaf = name.rpartition(".")[2]
        counts[leaf] = counts.get(leaf, 0) + 1
    parts = [f"{leaf} x{count}" for leaf, count in sorted(counts.items())]
    tensors = {name.split(".layers.")[-1].split(".", 1)[-1] for name in tuner.targeted_parameter_names}
    parts += [f"{name} (tensor)" for name in sorted(tensors)]
    return f"lora: adapters on {', '.join(parts) or 'nothing'}"


def local_path(path: str) -> str:
    """An existing local directory as an absolute path (so files that record it work from any directory);
    a hub id unchanged."""
    local = Path(path).expanduser()
    return str(local.resolve()) if local.is_dir() else path


def _qlora_kwargs(cfg: ModelConfig, local_rank: int, storage: str) -> dict:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UserError("model.method: qlora needs bitsandbytes: pip install 'ftkit[qlora]'") from None
    config = _from_pretrained(AutoConfig, cfg, "config")
    problem = quant.width_problem(quant.layer_widths(config.get_text_config().to_dict()))
    if problem:
        raise UserError(f"model.path: {cfg.path}: {problem}, which QLoRA needs")
    # One full copy per process on its own device, which FSDP2 shards after loading; under ZeRO-3
    # transformers refuses a device map and partitions the model as it builds it. A mixture of experts'
    # fused experts load to CPU memory first (16-bit, they would not fit the GPU) and go to it in 4-bit.
    staged = moe.expert_modules(config, cfg.trust_remote_code) if _gpu(local_rank) else []
    # A vision-language model's tower and projector stay in 16-bit: only the language model is quantized.
    keep = list(vision.TOWER_NAMES + vision.PROJECTOR_NAMES) if vision.is_vision(config.model_type) else None
    kwargs = {"quantization_config": quant.quant_config(quant.STORAGE_DTYPES[storage], bool(staged), keep)}
    if not is_deepspeed_zero3_enabled():
        kwargs["device_map"] = {"": _gpu(local_rank) or "cpu", **{name: "cpu" for name in staged}}
    return kwargs


def _gpu(local_rank: int) -> torch.device | None:
    """This process's GPU where a device map places the model (none on a CPU machine or under ZeRO-3)."""
    if torch.cuda.is_available() and not is_deepspeed_zero3_enabled():
        return torch.device("cuda", local_rank)
    return None


def remote_code_refusal(exc: ValueError) -> str:
    """One line for transformers' refusal to run a model's own code (else the error itself, unchanged)."""
    if "trust_remote_code" not in str(exc):
        raise exc
    return "it ships its own modelling code, which runs only with trust_remote_code set by you"


def raised_by_backend(exc: BaseException) -> bool:
    """Whether the error came from inside DeepSpeed (ZeRO-3 builds the model under its own init)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return any(f"{os.sep}deepspeed{os.sep}" in frame.filename for frame in frames)


def _from_pretrained(cls, cfg: ModelConfig, what: str, key: str = "model.path", **kwargs):
    try:
        return cls.from_pretrained(local_path(cfg.path), trust_remote_code=cfg.trust_remote_code, **kwargs)
    except (OSError, ValueError, SafetensorError) as exc:
        if raised_by_backend(exc):
            raise  # the distributed backend's own error (its config, its engine), not the model's files
        if isinstance(exc, ValueError) and "trust_remote_code" in str(exc):
            raise UserError(f"{key}: {cfg.path}: {remote_code_refusal(exc)}") from None
        # A missing or truncated file, a folder without a tokenizer: transformers' first line says which.
        raise UserError(
            f"{key}: cannot load the {what} from {cfg.path}: {str(exc).splitlines()[0]}"
        ) from None
