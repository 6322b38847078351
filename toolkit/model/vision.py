"""Vision-language models: which families load, their processor, and which of their parts train.

A vision-language model is a vision tower (an image encoder), a projector that maps its features into the
language model's embedding space, and the language model with its output head. transformers names these
parts alike across families (`vision_tower`/`visual`/`vision_model`, `multi_modal_projector`/`connector`/
`visual.merger`, `language_model`/`text_model`), so one set of name rules places every parameter.

By default only the language model trains (LoRA or full); `vision.train_projector` and
`vision.train_tower` (all blocks or the last `tower_blocks`) add the other parts.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

from torch import nn

from toolkit.config import LoraConfig, ModelConfig, VisionConfig
from toolkit.errors import UserError
from toolkit.model import moe
from toolkit.model.lora_targets import parameter_targets

# Families this toolkit trains (model_type -> what users call it), each checked to build, train and
# generate through the same code; others with a vision tower are refused by name.
FAMILIES = {
    "llava": "Llava",
    "llava_next": "Llava-NeXT",
    "mistral3": "Mistral-3 (Mistral-Small-3.1)",
    "idefics3": "Idefics3",
    "smolvlm": "SmolVLM",
    "qwen2_vl": "Qwen2-VL",
    "qwen2_5_vl": "Qwen2.5-VL",
    "qwen3_vl": "Qwen3-VL",
    "qwen3_5": "Qwen3.5",
    "qwen3_5_moe": "Qwen3.5-MoE",
    "gemma3": "Gemma-3",
    "gemma4": "Gemma-4",
}
# Name parts, checked in this order: a projector can sit inside the tower's module (Qwen's merger).
PROJECTOR_NAMES = (
    "multi_modal_projector",
    "connector",
    "visual.merger",
    "visual.deepstack_merger_list",
    "embed_vision",
)
TOWER_NAMES = ("vision_tower", "visual", "vision_model")
AUDIO_NAMES = ("audio_tower", "embed_audio")
"""An audio encoder and its projector (Gemma-4): image-text training never feeds them, so they stay frozen
and are never adapted, whatever the vision keys say."""
NEWLINE_PARAMS = ("image_newline",)
"""Learned parameters Llava-NeXT adds between image rows: part of the projector."""
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)
"""A processor's files besides the tokenizer's: an export carries them so it loads with AutoProcessor."""


def model_type(path: str, download: bool = True) -> str | None:
    """The model_type of the model at `path`: a local folder's config.json read as plain JSON (no model code
    runs), or a hub model's config as transformers finds it (cached, or downloaded when `download`: a
    question asked before any model loads, as the plan's, must not wait on the network's retries); None
    where neither can be read without the model's own code."""
    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        try:
            return json.loads((folder / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            return None
    if folder.exists() or not path:
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=not download).model_type
    except (OSError, ValueError):
        return None


def is_vision(kind: str | None) -> bool:
    """Whether `kind` (a model_type) is an image-text-to-text family transformers ships with a vision tower
    (Mistral-4 is listed as image-text-to-text but its config has no vision part: a text model)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if kind not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return False
    return "vision_config" in getattr(CONFIG_MAPPING[kind], "sub_configs", {"vision_config": None})


def auto_class(kind: str | None):
    """transformers' auto class that builds a `kind` model with its head (a text model that transformers
    lists only as image-text-to-text, as Mistral-4, through that class too)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if is_vision(kind) or (kind is not None and kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def attention_by_part(kind: str | None, attention: str) -> str | dict:
    """from_pretrained's `attn_implementation`: `attention` everywhere, but eager for an audio tower
    (Gemma-4's takes no other kernel, and image-text training never runs it)."""
    if not is_vision(kind):
        return attention
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    parts = getattr(CONFIG_MAPPING[kind], "sub_configs", {})
    if "audio_config" not in parts:
        return attention
    return {"": attention, **dict.fromkeys(parts, attention), "audio_config": "eager"}


def copy_processor_files(source: Path, out: Path) -> None:
    """A vision-language model's processor files from `source` (its folder, or an export of it) into the
    export `out`, where the tokenizer's own saving did not already write them (a text model has none)."""
    for name in PROCESSOR_FILES:
        if (source / name).is_file() and not (out / name).exists():
            shutil.copyfile(source / name, out / name)


def check_family(kind: str, path: str) -> None:
    """One line refusing a vision-language family this toolkit has not proven."""
    if kind not in FAMILIES:
        raise UserError(
            f"model.path: {path}: {kind} is a vision-language family ftkit does not train yet "
            f"(supported: {', '.join(sorted(FAMILIES))})"
        )


def load_processor(cfg: ModelConfig, key: str = "model.path"):
    """The model's processor (image processor + tokenizer + chat template), from its folder alone (an
    exported adapter's: from its base model's folder).

    Qwen's and Gemma-4's processors also build a video processor, which needs torchvision; image-only
    training does not, so without torchvision the processor is assembled from its image processor and
    tokenizer (Gemma-4's audio feature extractor left out too)."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    path = _config_folder(cfg.path)
    remote = cfg.trust_remote_code
    try:
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=remote)
    except (ImportError, ValueError) as exc:
        if "torchvision" not in str(exc).lower():
            raise UserError(f"{key}: cannot load the processor from {cfg.path}: {_first(exc)}") from None
        processor_class = image_only(_processor_class(path))
        others = set(processor_class.get_attributes()) - {"image_processor", "tokenizer"}
        processor = processor_class(
            image_processor=AutoImageProcessor.from_pretrained(path, trust_remote_code=remote),
            tokenizer=AutoTokenizer.from_pretrained(path, trust_remote_code=remote),
            **dict.fromkeys(others),
        )
    except OSError as exc:
        raise UserError(f"{key}: cannot load the processor from {cfg.path}: {_first(exc)}") from None
    if getattr(processor, "image_processor", None) is None:
        raise UserError(f"{key}: {cfg.path}: its processor has no image processor")
    tokenizer = processor.tokenizer
    if tokenizer.pad_token is None:  # batches need one; the eos token, as load.with_pad_token gives text
        tokenizer.pad_token = tokenizer.eos_token
    return processor


def image_inputs(cfg: ModelConfig, max_pixels: int | None, key: str = "model.path"):
    """A vision-language model's image handling for the data (its processor, image token, pixel budget);
    None for a text model."""
    from transformers import AutoConfig

    from toolkit.data.vision_rows import ImageInputs

    kind = kind_of(cfg.path)
    if not is_vision(kind):
        return None
    check_family(kind, cfg.path)
    processor = load_processor(cfg, key)
    tokenizer = processor.tokenizer
    tokenizer.chat_template = getattr(processor, "chat_template", None) or tokenizer.chat_template
    if not tokenizer.chat_template:
        raise UserError(f"{key}: {cfg.path}: no chat template to place images with; add one to it")
    config = AutoConfig.from_pretrained(_config_folder(cfg.path), trust_remote_code=cfg.trust_remote_code)
    return ImageInputs(processor, kind, image_token_id(config), max_pixels)


def _config_folder(path: str) -> str:
    """`path`, or for an exported adapter the base model it applies to (which holds config.json)."""
    folder = Path(path).expanduser()
    if (folder / "config.json").is_file() or not (folder / "adapter_config.json").is_file():
        return str(folder.resolve()) if folder.is_dir() else path
    adapter = folder / "adapter_config.json"
    return json.loads(adapter.read_text())["base_model_name_or_path"]


def image_only(processor_class):
    """`processor_class` taking None for its parts other than the image processor and the tokenizer (the
    video processor, an audio feature extractor): without torchvision transformers cannot even name the
    video processor's base class, and its argument check fails on the missing ones."""

    class ImageOnly(processor_class):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and argument_name not in ("image_processor", "tokenizer"):
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImageOnly.__name__ = ImageOnly.__qualname__ = processor_class.__name__
    return ImageOnly


def _processor_class(path: str):
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    return getattr(transformers, PROCESSOR_MAPPING_NAMES[kind_of(path)])


def kind_of(path: str) -> str | None:
    """The model_type of a model folder, or of the base an exported adapter in `path` applies to."""
    adapter = Path(path).expanduser() / "adapter_config.json"
    if (Path(path).expanduser() / "config.json").is_file() or not adapter.is_file():
        return model_type(path)
    return model_type(json.loads(adapter.read_text()).get("base_model_name_or_path") or "")


def _first(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def image_token_id(config) -> int:
    """The id of the token each image's features replace."""
    for key in ("image_token_id", "image_token_index"):
        value = getattr(config, key, None)
        if value is not None:
            return int(value)
    raise UserError(f"model.path: {config.model_type} names no image token in its config")


def part_of(name: str) -> str:
    """`tower`, `projector`, `audio` or `language model` for a parameter or module name (any wrapper
    prefix)."""
    if any(re.search(rf"(^|\.){p}\.", f"{name}.") for p in AUDIO_NAMES):
        return "audio"
    if any(f"{p}." in f"{name}." for p in PROJECTOR_NAMES) or name.rpartition(".")[2] in NEWLINE_PARAMS:
        return "projector"
    if any(re.search(rf"(^|\.){p}\.", f"{name}.") for p in TOWER_NAMES):
        return "tower"
    return "language model"


def tower_blocks(model: nn.Module) -> list[str]:
    """Names of the tower's repeated blocks, in order: its longest ModuleList outside the projector."""
    lists = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and part_of(name) == "tower"
    ]
    if not lists:
        return []
    name, blocks = max(lists, key=lambda item: len(item[1]))
    return [f"{name}.{i}" for i in range(len(blocks))]


def trained_tower_blocks(model: nn.Module, cfg: VisionConfig) -> list[str]:
    """The tower blocks `cfg` trains (none unless train_tower; the last tower_blocks, or all)."""
    if not cfg.train_tower:
        return []
    blocks = tower_blocks(model)
    if cfg.tower_blocks > len(blocks):
        raise UserError(f"vision.tower_blocks: {cfg.tower_blocks}, but the tower has {len(blocks)} blocks")
    return blocks[-cfg.tower_blocks :] if cfg.tower_blocks else blocks


def in_blocks(name: str, blocks: list[str]) -> bool:
    return any(name.startswith(f"{block}.") or name == block for block in blocks)


def freeze_for_full(model: nn.Module, cfg: VisionConfig) -> None:
    """Full fine-tuning: the language model trains; the tower and projector only as `cfg` says."""
    blocks = trained_tower_blocks(model, cfg)
    whole_tower = cfg.train_tower and not cfg.tower_blocks
    for name, param in model.named_parameters():
        part = part_of(name)
        if part == "projector":
            param.requires_grad_(cfg.train_projector)
        elif part == "tower":
            param.requires_grad_(whole_tower or in_blocks(name, blocks))
        elif part == "audio":
            param.requires_grad_(False)


def lora_targets(model: nn.Module, lora: LoraConfig, cfg: VisionConfig) -> dict:
    """peft keywords for a vision-language model: adapters on the language model's linear layers that
    `lora.target_modules` names (and the trained tower blocks'), the projector saved whole when trained. A
    mixture-of-experts language model's parts follow `lora`'s part keys as on a text model (lora_targets):
    its routed experts' fused tensors and its routers' weights are parameter targets."""
    head = model.get_output_embeddings()
    wanted = lora.target_modules
    blocks = trained_tower_blocks(model, cfg)
    routed = bool(moe.routing(model.config).experts)
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is head:
            continue
        part = part_of(name)
        if part in ("projector", "audio") or (part == "tower" and not in_blocks(name, blocks)):
            continue
        if routed and part == "language model" and not _moe_part_wanted(lora, name):
            continue
        if wanted == "all-linear" or _named_by(name, wanted):
            names.append(name)
    if not names:
        raise UserError(f"lora.target_modules: {wanted}: no linear layer of the language model matches")
    projector = _projector_modules(model) if cfg.train_projector else None
    targets = {"target_modules": names, "modules_to_save": projector}
    return {**targets, **_expert_targets(model, lora)} if routed else targets


def _moe_part_wanted(lora: LoraConfig, name: str) -> bool:
    part = moe.part_of(name)
    return {"attention": lora.attention, "shared expert": lora.shared_expert, "router": lora.router}.get(
        part, True
    )


def _expert_targets(model: nn.Module, lora: LoraConfig) -> dict:
    """The language model's routed experts (lora.experts) and routers' weights that are no linear layer
    (lora.router) as peft's parameter targets, named inside their decoder layer; the fused gate and up
    projections get twice the rank and alpha, as on a text model."""
    # Only the experts' own tensors: a tower keeps other 3-D weights (Gemma-4's position table).
    experts = [name for name in moe.expert_parameter_names(model) or [] if "experts" in name.split(".")]
    found = set(experts) if lora.experts else set()
    if lora.router:
        found |= {
            moe.in_layer(name)
            for name, _ in model.named_parameters()
            if part_of(name) == "language model"
            and moe.part_of(name) == "router"
            and name.endswith(".weight")
            and not isinstance(model.get_submodule(name.rpartition(".")[0]), nn.Linear)
        }
    return parameter_targets(lora, sorted(found))


def _named_by(name: str, wanted: str | list[str]) -> bool:
    if isinstance(wanted, str):
        return re.fullmatch(wanted, name) is not None
    return any(name == w or name.endswith(f".{w}") for w in wanted)


def _projector_modules(model: nn.Module) -> list[str]:
    """The projector's top modules by their last name part (what peft's modules_to_save matches)."""
    found = []
    for name, _ in model.named_modules():
        if part_of(name) == "projector" and part_of(name.rpartition(".")[0]) != "projector":
            found.append(name.rpartition(".")[2])
    return sorted(set(found)) or None


def keep_present_blocks(model: nn.Module) -> None:
    """Its `_no_split_modules` cut to the classes the model is built from. A vision-language model lists
    its towers' whole families (CLIP's text embeddings beside its vision layers), a text model can list
    its vision-language sibling's (Qwen3.5's causal LM names the vision block), and FSDP's wrapping by
    those classes stops at the first one it cannot find."""
    listed = getattr(model, "_no_split_modules", None)
    if listed:
        present = {type(module).__name__ for module in model.modules()}
        model._no_split_modules = sorted(name for name in listed if name in present)


def current_layout_only(model: nn.Module) -> None:
    """Save in the hub layout transformers writes today. Loaded under ZeRO-3, transformers records its
    legacy renamings and prefix changes too (Llava's `language_model.model.model`, CLIP's `vision_model`,
    Qwen3.5's text model's `model.language_model`), and saving reverses every recorded one: the export's
    names came out doubled (`language_model.model.model.layers...`) or prefixed. Elsewhere the recorded
    ones are right (and rebuilding them fails on FSDP2's renamed class), so they stay."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange
    from transformers.integrations import is_deepspeed_zero3_enabled

    if hasattr(model, "_weight_conversions") and is_deepspeed_zero3_enabled():
        # What a model built from its config reverses when saving (export.verify_export's expectation).
        mapping = get_model_conversion_mapping(model, add_legacy=False)
        model._weight_conversions = [entry for entry in mapping if not isinstance(entry, PrefixChange)]


def trained_by_part(model: nn.Module) -> dict[str, tuple[int, int]]:
    """(trained, total) parameter counts per part, counted at full size (ZeRO-3 partitions included); the
    audio part only where the model has one."""
    counts = {"tower": [0, 0], "projector": [0, 0], "audio": [0, 0], "language model": [0, 0]}
    for name, param in model.named_parameters():
        entry = counts[part_of(name)]
        size = math.prod(moe.full_shape(param))
        entry[1] += size
        entry[0] += size if param.requires_grad else 0
    return {part: (trained, total) for part, (trained, total) in counts.items() if total or part != "audio"}


def parts_line(model: nn.Module) -> str:
    """The start-up line: what trains in each part."""
    described = []
    for part, (trained, total) in trained_by_part(model).items():
        state = "frozen" if not trained else f"{trained:,} trained"
        described.append(f"{part} {state} of {total:,}")
    return f"vision: {model.config.model_type}; " + ", ".join(described)


def tower_rate(model: nn.Module, cfg: VisionConfig) -> tuple[set[str], float] | None:
    """(names of the trained tower parameters, `cfg.tower_learning_rate`), or None where it is not set or
    nothing of a tower trains (optim.build_optimizer's `own_lr`)."""
    names = {name for name, p in model.named_parameters() if p.requires_grad and part_of(name) == "tower"}
    return (names, cfg.tower_learning_rate) if cfg.tower_learning_rate is not None and names else None
