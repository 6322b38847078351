"""What the launch checks learn from the model's config, read once per launch and handed to each check: its
type and sizes, the module classes it is built from, the tensor-parallel plan transformers ships for it, and
whether it is a mixture of experts. Reading runs none of the model's own code: with `trust_remote_code` only
the plain config.json of a local model is read, and what needs the config class stays unknown (None) until
the model loads."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, PretrainedConfig

from toolkit.config import ModelConfig
from toolkit.model.families import Family, family_of
from toolkit.model.load import local_path
from toolkit.model.moe import EXPERT_KEYS


@dataclass(frozen=True)
class ModelFacts:
    path: str
    """model.path as the config gives it."""
    config: object | None = None
    """The transformers config; None where it cannot be read without the model's code, or not at all."""
    raw: dict | None = None
    """config.json's keys and values (known for a local model even when `config` is not)."""
    module_classes: frozenset[str] | None = None
    """Names of the torch module classes the model is built from (None: not known before loading)."""
    attention_kernels: frozenset[str] | None = None
    """The `attn_implementation`s its causal LM class takes (None: not known before loading)."""

    @property
    def model_type(self) -> str | None:
        return (self.raw or {}).get("model_type")

    @property
    def num_layers(self) -> int | None:
        return (self.raw or {}).get("num_hidden_layers")

    @property
    def tp_plan(self) -> dict | None:
        return getattr(self.config, "base_model_tp_plan", None)

    @property
    def family(self) -> Family | None:
        """What its layers are (toolkit/model/families.py); with `trust_remote_code`, read by transformers'
        own config class of its model_type where there is one; None where neither can be read."""
        if self.config is not None:
            return family_of(self.config)
        if not self.raw:
            return None
        try:
            return family_of(AutoConfig.for_model(**PretrainedConfig._decode_special_floats(self.raw)))
        except (ValueError, TypeError, KeyError, StrictDataclassError):
            return None

    @property
    def experts(self) -> int:
        """Routed experts per MoE layer (0: a dense model)."""
        raw = self.raw or {}
        return max((int(raw.get(key) or 0) for key in EXPERT_KEYS), default=0)


def read_model_facts(cfg: ModelConfig) -> ModelFacts:
    """The facts of `cfg.path`, from one read of its config (a path that cannot be read gives facts that
    are all unknown: the model load itself says why, in one line)."""
    if cfg.trust_remote_code:
        config_file = Path(cfg.path).expanduser() / "config.json"
        raw = json.loads(config_file.read_text()) if config_file.is_file() else None
        return ModelFacts(cfg.path, raw=raw)
    try:
        config = AutoConfig.from_pretrained(local_path(cfg.path))
    except (OSError, ValueError):
        return ModelFacts(cfg.path)
    causal_lm = _causal_lm_class(config.model_type)
    if causal_lm is None:
        return ModelFacts(cfg.path, config, config.to_dict())
    return ModelFacts(
        cfg.path, config, config.to_dict(), _module_classes(causal_lm), _attention_kernels(causal_lm)
    )


def _causal_lm_class(model_type: str):
    """Transformers' causal LM class for `model_type`, or None where it has none."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    # A vision-language model's class with its head is the image-text-to-text one.
    class_name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(
        model_type
    ) or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return getattr(transformers, class_name, None) if class_name else None


def _attention_kernels(causal_lm) -> frozenset[str]:
    flags = {
        "sdpa": "_supports_sdpa",
        "flash_attention_2": "_supports_flash_attn",
        "flex_attention": "_supports_flex_attn",
    }
    return frozenset(["eager", *(name for name, flag in flags.items() if getattr(causal_lm, flag, False))])


def _module_classes(causal_lm) -> frozenset[str]:
    """Every torch module class in the modeling file of the model's causal LM."""
    module = importlib.import_module(causal_lm.__module__)
    return frozenset(
        name
        for name, obj in vars(module).items()
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module)
    )
