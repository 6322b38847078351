"""A model's shape and exact parameter counts, from its config alone: the model is built on the meta device,
so no weights are read or downloaded and even a 70B model costs no memory."""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit import console
from toolkit.config import LoraConfig as RecipeLora
from toolkit.config import VisionConfig
from toolkit.errors import UserError
from toolkit.model import backbone, lora_targets, moe, scalar, vision
from toolkit.model.families import family_of, widest
from toolkit.plan import architectures, hub
from toolkit.plan.images import VisionCounts, count_vision
from toolkit.plan.memory import ATTENTION
from toolkit.train.head import logit_change_problem


@dataclass(frozen=True)
class ModelCounts:
    """Parameter counts (unique tensors, tied weights once) and the dimensions the estimates need."""

    source: str
    """Where the config came from: a path, the built-in table, the local Hugging Face cache, or the hub."""
    model_type: str
    method: str
    """full | lora | qlora: decides what is trainable."""
    lora_r: int
    total: int
    """Every parameter of the trained model, adapters included."""
    trainable: int
    frozen: int
    quantizable: int
    """Frozen linear-layer weights outside the output head: what QLoRA stores in 4 bits."""
    matmul_frozen: int
    """Weights of frozen matrix multiplications per token (linear layers and the output head, tied or not)."""
    matmul_trainable: int
    largest_layer: int
    """Parameters of the largest decoder layer: what a sharded backend gathers at once."""
    zero3_persistent: int
    """Parameters of tensors with at most 10 x hidden elements, which ZeRO-3 keeps whole on every rank
    (accelerate's "auto" stage3_param_persistence_threshold)."""
    embed: int
    lm_head: int
    layers: int
    hidden: int
    intermediate: int
    """The MLP width one token's activations span (an MoE's: its experts' and the shared expert's)."""
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layer_kinds: str = ""
    """The decoder layers in words (toolkit/model/families.py): "18 gated DeltaNet + 6 attention layers"."""
    cache: tuple[tuple[int, int], ...] = ()
    """Each attention layer's generation cache as (elements per token, tokens kept; 0: all): K and V of
    every kv head, or multi-head latent attention's compressed cache (`latent_cache`); see
    toolkit/model/families.py."""
    recurrent: str = ""
    """The first layer kind that carries a state along the sequence ("": none): such a model's sequences
    are never cut across processes."""
    latent_cache: bool = False
    """The cache is MLA's latent (kv_lora_rank + qk_rope_head_dim): tensor parallelism does not split it."""
    mixers: tuple[tuple[str, ...], ...] = ()
    """Each decoder layer's sequence mixers as the activations count them: "attention", or a recurrent
    kind's name where `recurrent_kept` has it (none: feed-forward only; an empty tuple: every layer
    attention and an MLP)."""
    recurrent_kept: tuple[tuple[str, tuple[int, int, int]], ...] = ()
    """Per recurrent kind, what one such layer keeps per token for backward: (compute-dtype elements, fp32
    elements, its output projection's input width), from toolkit/model/families.py's `Kept`."""
    packing_leak: str = ""
    """The layer kind that would let one packed example reach the next ("": packing is exact; the recipe
    refuses data.packing otherwise)."""
    mlp_alone: bool = False
    """The MLPs are layers of their own (Nemotron-H): a mixer layer has none."""
    state_per_sequence: int = 0
    """Elements the recurrent layers (linear attention, convolution, Mamba) keep per sequence while
    generating, whatever its length, instead of a per-token cache."""
    positions: int = 0
    """The config's max_position_embeddings: the longest sequence the model was made for (0: none named)."""
    experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""
    experts_per_token: int = 0
    expert_params: int = 0
    """Parameters of the routed experts' fused 3-D tensors, every layer's: 4-bit under QLoRA."""
    active: int = 0
    """Parameters one token goes through: all but the routed experts it is not sent to."""
    tp_styles: tuple[str, ...] = ()
    """The split styles of the model's transformers `base_model_tp_plan` (none: it has no such plan)."""
    tp_split_frozen: int = 0
    """Frozen parameters of the modules that plan splits (the attention and MLP linears of every layer)."""
    tp_split_trainable: int = 0
    """Trainable parameters of those modules: their weights (full fine-tuning) or adapters (LoRA)."""
    pipeline_parts: tuple[tuple[int, int], ...] = ()
    """(parameters, trainable) of what a pipeline splits, in order: what comes before the decoder layers (the
    input embeddings), each decoder layer (adapters included), what comes after them (final norm, head)."""
    vision: VisionCounts | None = None
    head_chunks: bool = True
    """Whether the chunked loss head reproduces the model's logits (loss.head auto chunks only then)."""
    """A vision-language model's tower and projector (None: a text model). The totals above include them;
    the shapes and the per-part counts are the language model's."""


def load_model_config(model: str):
    """The transformers config of a local model dir, a config.json path, a built-in hub id, or another hub id
    (its config.json from the local cache, else fetched alone from the hub unless offline: `plan.hub`).

    Every config.json is read as plain JSON: no model code runs, whatever the repository ships.
    """
    from transformers import AutoConfig

    path = Path(model).expanduser()
    file = path / "config.json" if path.is_dir() else path
    if path.exists():
        if not file.is_file():
            raise UserError(f"--model {model}: directory has no config.json")
        return _trained_family(_config_from_dict(_read_json(file), model), model), str(file)
    built_in = architectures.lookup(model)
    if built_in is not None:
        return AutoConfig.for_model(**built_in), "built-in table"
    file, source = hub.config_json(model, architectures.known_ids())
    return _trained_family(_config_from_dict(_read_json(file), model), model), source


def _trained_family(config, model: str):
    """`config`, unless it is a vision-language family ftkit does not train (the recipe refuses it too)."""
    kind = config.model_type
    if vision.is_vision(kind) and kind not in vision.FAMILIES:
        raise UserError(
            f"--model {model}: {kind} is a vision-language family ftkit does not train yet "
            f"(supported: {', '.join(sorted(vision.FAMILIES))})"
        )
    return config


def count_parameters(
    config,
    method: str,
    lora_r: int,
    source: str = "",
    parts: VisionConfig | None = None,
    scores: int | None = None,
) -> ModelCounts:
    """Exact counts for `method`; LoRA adapters are the recipe's default ones at rank `lora_r`, on meta. On a
    vision-language model `parts` (the recipe's vision section) chooses what of the tower and projector
    trains, as the recipe does; the language model is counted as a text model's. `scores` (the embedding
    recipe): None counts the causal LM; 0 the bare transformer without its LM head (an embedding model);
    more, a sequence classifier with that many scores a sequence (a reranker's 1, a classifier's labels),
    its head trained beside the adapters as the recipe's."""
    model = build_meta_model(config) if scores is None else _embed_meta_model(config, scores)
    seeing = vision.is_vision(config.model_type)
    parts = parts or VisionConfig()
    if seeing:
        _check_tower_blocks(model, parts)
    if method in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        # peft calls a transformers method that is deprecated in this version, and notes that GPT-2's Conv1D
        # layers store their weights transposed: neither warning is the user's.
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", "fan_in_fan_out", UserWarning)
            warnings.filterwarnings("ignore", console.PEFT_PATTERNS, RuntimeWarning)  # see there
            lora = RecipeLora(r=lora_r)  # the recipe's defaults
            targets = (
                vision.lora_targets(model, lora, parts) if seeing else lora_targets.peft_targets(lora, model)
            )
            task = "CAUSAL_LM" if scores is None else (scalar.PEFT_TASK if scores else backbone.PEFT_TASK)
            model = get_peft_model(model, LoraConfig(r=lora_r, task_type=task, **targets))
    else:
        model.requires_grad_(True)
        if seeing:
            vision.freeze_for_full(model, parts)
    text = config.get_text_config()
    if not seeing:
        return _counts(model, text, method, lora_r, source)
    language = _counts(_LanguageModel(model), text, method, lora_r, source)
    return _with_vision(language, count_vision(model, config, 10 * text.hidden_size), config.model_type)


def _check_tower_blocks(model, parts: VisionConfig) -> None:
    blocks = len(vision.tower_blocks(model))
    if parts.train_tower and parts.tower_blocks > blocks:
        raise UserError(f"--tower-blocks {parts.tower_blocks}: the tower has {blocks} blocks")


class _LanguageModel(torch.nn.Module):
    """A vision-language model's language model and output head: the causal LM a text plan counts."""

    def __init__(self, model):
        super().__init__()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft's wrapper
        self.decoder = base.get_decoder()
        self.head = base.get_output_embeddings()
        self._no_split_modules = base._no_split_modules
        self.config = base.config  # the whole model's: what decides whether the chunked head can be used

    def get_input_embeddings(self):
        return self.decoder.get_input_embeddings()

    def get_output_embeddings(self):
        return self.head


def _with_vision(language: ModelCounts, v: VisionCounts, model_type: str) -> ModelCounts:
    """The language model's counts with the tower's and projector's parameters added to the totals."""
    trainable = v.tower_trainable + v.projector_trainable
    frozen = v.tower + v.projector - trainable
    return dataclasses.replace(
        language,
        model_type=model_type,
        total=language.total + trainable + frozen,
        trainable=language.trainable + trainable,
        frozen=language.frozen + frozen,
        zero3_persistent=language.zero3_persistent + v.persistent,
        vision=v,
    )


SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size")


def check_sizes(raw: dict, model: str) -> None:
    """Sizes that are not positive counts would end in a division by zero inside transformers."""
    for section in (raw, raw.get("text_config") or {}):
        for name in SIZES:
            value = section.get(name)
            if value is not None and not (isinstance(value, int) and value > 0):
                raise UserError(
                    f"--model {model}: config.json: {name} must be a positive integer, got {value}"
                )


def build_meta_model(config):
    """The causal LM (or image-text-to-text model) for `config` with every tensor on the meta device (shapes
    only, no storage)."""
    try:
        with torch.device("meta"):
            return vision.auto_class(config.model_type).from_config(config)
    except (ValueError, KeyError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(
            f"model type {config.model_type!r} is not a causal LM transformers can build: {first}"
        ) from None


def _embed_meta_model(config, scores: int):
    """The embedding recipe's model on meta: the bare transformer (`scores` 0) or its sequence classifier
    with `scores` outputs, as `toolkit.model.load` loads them."""
    import copy

    if vision.is_vision(config.model_type):
        raise UserError(
            f"--objective embed: {config.model_type} is a vision-language model; embed a text model"
        )
    if scores:
        config = copy.deepcopy(config)
        config.num_labels = scores
    auto = scalar.auto_class() if scores else backbone.auto_class()
    try:
        with torch.device("meta"):
            return auto.from_config(config)
    except (ValueError, KeyError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(
            f"model type {config.model_type!r}: transformers cannot build its {auto.__name__}: {first}"
        ) from None


def _counts(model, text, method: str, lora_r: int, source: str) -> ModelCounts:
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    expert_params = sum(
        p.numel() for m in model.modules() for p in m.parameters(recurse=False) if moe.is_routed_expert(p, m)
    )
    # A dense model whose config keeps a mixture's defaults (Nemotron-H-8B: no "moe" layer) routes nothing.
    routing = moe.routing(text) if expert_params else moe.Routing()
    matmul_frozen, matmul_trainable = moe.matmul_weights(model, routing.active_share)
    quantizable = sum(m.weight.numel() for m in linears if m is not head and not m.weight.requires_grad)
    layer_names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_names]
    heads = text.num_attention_heads
    kv_heads = widest(text, "num_key_value_heads") or heads
    head_dim = widest(text, "head_dim") or text.hidden_size // heads
    family = family_of(text)
    tp_plan = getattr(text, "base_model_tp_plan", None) or {}
    split_frozen, split_trainable = _tp_split(model, tp_plan)
    return ModelCounts(
        source=source,
        model_type=text.model_type,
        method=method,
        lora_r=lora_r,
        total=total,
        trainable=trainable,
        frozen=total - trainable,
        quantizable=quantizable,
        matmul_frozen=matmul_frozen,
        matmul_trainable=matmul_trainable,
        largest_layer=max((sum(p.numel() for p in m.parameters()) for m in layers), default=0),
        zero3_persistent=sum(p.numel() for p in params if p.numel() <= 10 * text.hidden_size),
        embed=model.get_input_embeddings().weight.numel(),
        lm_head=head.weight.numel() if head is not None else 0,
        layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        intermediate=routing.active_width or _mlp_width(text),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=text.vocab_size,
        layer_kinds=family.describe(),
        cache=family.cache,
        latent_cache=bool(family.latent_kv),
        recurrent=family.recurrent[0].name if family.recurrent else "",
        state_per_sequence=family.state_elements(text),
        **_activation_shapes(family, text),
        packing_leak=family.leaks.name if family.leaks else "",
        positions=getattr(text, "max_position_embeddings", None) or 0,
        experts=routing.experts,
        experts_per_token=routing.per_token,
        expert_params=expert_params,
        active=total - round(expert_params * (1 - routing.active_share)),
        head_chunks=logit_change_problem(model.config) is None,
        tp_styles=tuple(sorted(set(tp_plan.values()))),
        tp_split_frozen=split_frozen,
        tp_split_trainable=split_trainable,
        pipeline_parts=_pipeline_parts(params, layers),
    )


def _activation_shapes(family, text) -> dict:
    """`ModelCounts.mixers`, `recurrent_kept` and `mlp_alone`: a recurrent kind without a formula of what it
    keeps is counted as attention."""
    kept = {kind.name: kind.kept(text) for kind in family.recurrent if kind.kept}
    mixers = tuple(
        tuple(kind.name if kind.name in kept else ATTENTION for kind in layer) for layer in family.layers
    )
    return {
        "mixers": mixers,
        "recurrent_kept": tuple((name, (k.compute, k.fp32, k.inner)) for name, k in kept.items()),
        "mlp_alone": any(not layer for layer in family.layers),
    }


def _mlp_width(text) -> int:
    """The MLP's inner width: GPT-2 calls it n_inner and leaves it None for 4 x hidden."""
    width = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None)
    return width or 4 * text.hidden_size


def _pipeline_parts(params: list, layers: list) -> tuple[tuple[int, int], ...]:
    """`ModelCounts.pipeline_parts`: a parameter outside the decoder layers goes with the first stage when
    the model registers it before them, else with the last."""
    layer_of = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
    parts = [[0, 0] for _ in range(len(layers) + 2)]
    past_layers = False
    for p in params:
        index = layer_of.get(id(p))
        past_layers = past_layers or index is not None
        slot = index + 1 if index is not None else (-1 if past_layers else 0)
        parts[slot][0] += p.numel()
        parts[slot][1] += p.numel() if p.requires_grad else 0
    return tuple((numel, trainable) for numel, trainable in parts)


def _tp_split(model, tp_plan: dict[str, str]) -> tuple[int, int]:
    """(frozen, trainable) parameters that tensor parallelism splits: the linear layers the plan names and,
    under LoRA, the one adapter piece split with each (`toolkit.model.tensor_parallel`); the other stays
    whole."""
    from toolkit.model.tensor_parallel import split_styles

    modules = dict(model.named_modules())
    params = {id(p): p for name in split_styles(model, tp_plan) for p in modules[name].parameters()}.values()
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    return frozen, sum(p.numel() for p in params) - frozen


def _config_from_dict(raw: dict, model: str):
    from transformers import AutoConfig
    from transformers import __version__ as transformers_version
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "model_type" not in raw:
        raise UserError(f"--model {model}: config.json has no model_type")
    if raw["model_type"] not in CONFIG_MAPPING:
        raise UserError(
            f"--model {model}: model_type {raw['model_type']!r} is not one transformers "
            f"{transformers_version} knows, and ftkit never runs a repository's own model code"
        )
    check_sizes(raw, model)
    try:
        return AutoConfig.for_model(**raw)
    except ValueError as exc:
        raise UserError(f"--model {model}: {str(exc).splitlines()[0]}") from None


def _read_json(file: Path) -> dict:
    from transformers import PretrainedConfig

    try:
        # transformers writes Infinity and NaN as {"__float__": "Infinity"} (Nemotron-H's time_step_limit)
        raw = PretrainedConfig._decode_special_floats(json.loads(file.read_text()))
    except json.JSONDecodeError as exc:
        raise UserError(f"{file}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{file}: expected a JSON object")
    return raw
