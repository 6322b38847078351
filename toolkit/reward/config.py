"""The reward-model recipe's config: the shared recipe config plus a `reward` section."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from toolkit.config import RecipeConfig, load_config
from toolkit.errors import UserError
from toolkit.fields import NonNegativeFloat, NonNegativeInt
from toolkit.preference.config import check_pair_data

DEMO_RM_CONFIG = Path(__file__).resolve().parents[1] / "assets" / "demo-rm.yaml"


@dataclass
class RewardConfig:
    center_coefficient: NonNegativeFloat = 0.0
    """Weight of the mean squared sum of each pair's two rewards in the loss: keeps the scores centred on
    zero (0: off; TRL's center_rewards_coefficient, 0.01 in its reference)."""
    max_prompt_length: NonNegativeInt = 0
    """Prompt tokens kept (from the end) when a pair exceeds data.max_length; 0 means half of it."""


@dataclass
class RewardRecipeConfig(RecipeConfig):
    output_dir: str = "runs/demo-rm"
    """Where config.yaml, metrics.jsonl, checkpoints/ and final/ are written."""
    reward: RewardConfig = field(default_factory=RewardConfig)


def load_reward_config(path: str | Path | None, overrides: list[str]) -> RewardRecipeConfig:
    """The recipe config at `path` (the demo when None), checked for what a reward model needs."""
    cfg = load_config(path or DEMO_RM_CONFIG, overrides, schema=RewardRecipeConfig)
    validate_reward(cfg)
    return cfg


def validate_reward(cfg: RewardRecipeConfig) -> None:
    if cfg.reward.max_prompt_length >= cfg.data.max_length:
        raise UserError(
            f"reward.max_prompt_length: must be below data.max_length={cfg.data.max_length}, "
            f"got {cfg.reward.max_prompt_length}"
        )
    check_pair_data(cfg)
    if cfg.pipeline.size > 1:
        raise UserError("pipeline.size: reward models do not train on a pipeline; use fsdp or zero3")
    if cfg.loss.head == "chunked":
        raise UserError("loss.head: chunked scores vocabulary tokens; a reward model's head is one number")


def prompt_budget(cfg: RewardRecipeConfig) -> int:
    """Prompt tokens a too-long pair keeps."""
    return cfg.reward.max_prompt_length or cfg.data.max_length // 2
