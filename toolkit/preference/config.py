"""The preference recipe's config: the shared recipe config plus a `dpo` section."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from toolkit.config import RecipeConfig, check_local_path, load_config
from toolkit.errors import UserError
from toolkit.fields import NonNegativeFloat, PositiveFloat

DEMO_DPO_CONFIG = Path(__file__).resolve().parents[1] / "assets" / "demo-dpo.yaml"
REFERENCE_FREE = ("simpo", "orpo")


@dataclass
class DpoConfig:
    loss: Literal["sigmoid", "ipo", "simpo", "orpo", "kto"] = "sigmoid"
    """Objective: sigmoid (DPO) | ipo | simpo (reference-free, length-normalised) | orpo (reference-free,
    odds ratio plus NLL of the chosen completion) | kto (rows of one completion flagged desirable or not;
    pairs are split into both)."""
    beta: float = 0.1
    """Strength of the preference term: DPO/SimPO/KTO temperature, IPO regulariser, ORPO's odds-ratio
    weight."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (used by loss simpo only)."""
    sft_weight: NonNegativeFloat | None = None
    """Weight of the chosen completions' NLL (per chosen token) in the loss: keeps the chosen answers likely
    while the margin grows (DPO lowers both otherwise). Unset: 0, except ORPO's own 1."""
    max_prompt_length: int = 0
    """Prompt tokens kept (from the end) when a pair exceeds data.max_length; 0 means half of it."""
    reference_model: str | None = None
    """Separate frozen reference model (path or hub id); unset: the policy's starting point (adapter off
    for LoRA, precomputed log-probs for a full fine-tune)."""
    precompute_reference: bool = False
    """Compute reference log-probs once before training and reuse them (always so for a full fine-tune
    without dpo.reference_model)."""


@dataclass
class KtoConfig:
    desirable_weight: PositiveFloat = 1.0
    """Weight of each desirable row's loss (raise it when desirable rows are the fewer: the KTO paper keeps
    desirable_weight x desirable rows / (undesirable_weight x undesirable rows) within [1, 4/3])."""
    undesirable_weight: PositiveFloat = 1.0
    """Weight of each undesirable row's loss."""


@dataclass
class PreferenceConfig(RecipeConfig):
    output_dir: str = "runs/demo-dpo"
    """Where config.yaml, metrics.jsonl, checkpoints/, reference log-probs and final/ are written."""
    dpo: DpoConfig = field(default_factory=DpoConfig)
    kto: KtoConfig = field(default_factory=KtoConfig)


def load_preference_config(path: str | Path | None, overrides: list[str]) -> PreferenceConfig:
    """The recipe config at `path` (the demo when None), checked for what preference tuning needs."""
    cfg = load_config(path or DEMO_DPO_CONFIG, overrides, schema=PreferenceConfig)
    set_here = any(item.partition("=")[0].strip() == "dpo.sft_weight" for item in overrides)
    validate_preference(cfg, "the command line" if set_here else str(path or DEMO_DPO_CONFIG))
    return cfg


def validate_preference(cfg: PreferenceConfig, source: str = "the config") -> None:
    """The preference recipe's own checks; `source`: where dpo.sft_weight was set, for its message."""
    if cfg.dpo.beta <= 0:
        raise UserError(f"dpo.beta: must be positive, got {cfg.dpo.beta}")
    if not 0 <= cfg.dpo.max_prompt_length < cfg.data.max_length:
        raise UserError(
            f"dpo.max_prompt_length: must be in [0, data.max_length={cfg.data.max_length}), "
            f"got {cfg.dpo.max_prompt_length}"
        )
    check_pair_data(cfg)
    if cfg.dpo.loss in REFERENCE_FREE and (cfg.dpo.reference_model or cfg.dpo.precompute_reference):
        raise UserError(f"dpo.loss {cfg.dpo.loss} uses no reference model; unset dpo.reference_model")
    if cfg.dpo.loss == "kto" and cfg.dpo.sft_weight:
        raise UserError(
            f"dpo.sft_weight: {cfg.dpo.sft_weight} (set in {source}) weighs a chosen answer's NLL, and KTO's "
            "rows are desirable or not, with no chosen answer: add dpo.sft_weight=null"
        )
    if cfg.dpo.loss == "kto" and cfg.pipeline.size > 1:
        raise UserError("pipeline.size: dpo.loss kto does not run on a pipeline; use fsdp or zero3")
    if cfg.dpo.reference_model:
        check_local_path(cfg.dpo.reference_model, "dpo.reference_model")


def check_pair_data(cfg: RecipeConfig) -> None:
    """What every recipe that reads preference pairs refuses of the data section."""
    if cfg.data.packing:
        raise UserError("data.packing is for SFT; pairs are batched whole (data.group_by_length pads less)")
    if cfg.data.streaming:
        raise UserError("data.streaming is for SFT (it packs rows); pairs are read whole, before training")
    if cfg.data.format != "auto":
        raise UserError("data.format: preference layouts are detected from the records; leave it auto")


def prompt_budget(cfg: PreferenceConfig) -> int:
    """Prompt tokens a too-long pair keeps."""
    return cfg.dpo.max_prompt_length or cfg.data.max_length // 2


def uses_reference(cfg: PreferenceConfig) -> bool:
    return cfg.dpo.loss not in REFERENCE_FREE


def precomputes_reference(cfg: PreferenceConfig) -> bool:
    """Reference log-probs from a first pass: asked for, or a full fine-tune with no other reference."""
    if not uses_reference(cfg):
        return False
    return cfg.dpo.precompute_reference or (cfg.model.method == "full" and not cfg.dpo.reference_model)
