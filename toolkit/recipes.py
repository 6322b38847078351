"""The recipes ftkit ships and which one a config is for: the script, the config schema and the loader of
each, told by the config's own sections (`dpo`: preference tuning, `grpo`: GRPO, `reward`: a reward
model, `embed`: an embedding model, none of them: SFT).

This sits above the schemas (toolkit/config.py and each recipe's section beside its code), so no schema
imports another; `ftkit train`, `ftkit check-config`, `ftkit plan` and export all choose here."""

from __future__ import annotations

from pathlib import Path

from toolkit.config import RecipeConfig, load_config
from toolkit.embed.config import EmbedRecipeConfig, load_embed_config
from toolkit.errors import UserError
from toolkit.grpo.config import GrpoRecipeConfig, load_grpo_config
from toolkit.preference.config import PreferenceConfig, load_preference_config
from toolkit.reward.config import RewardRecipeConfig, load_reward_config
from toolkit.typed_yaml import read_yaml_mapping

SCRIPTS = {
    "sft": "recipes/finetune_llm.py",
    "dpo": "recipes/dpo_llm.py",
    "grpo": "recipes/grpo_llm.py",
    "rm": "recipes/reward_llm.py",
    "embed": "recipes/embed_llm.py",
}
"""Each recipe's launchable script, relative to the checkout's root."""
SCHEMAS = {
    "sft": RecipeConfig,
    "dpo": PreferenceConfig,
    "grpo": GrpoRecipeConfig,
    "rm": RewardRecipeConfig,
    "embed": EmbedRecipeConfig,
}


def recipe_of(path: str | Path | None) -> str:
    """The recipe the config at `path` is for, by its sections (SFT for the demo, `path` None)."""
    sections = read_yaml_mapping(Path(path), "config file") if path else {}
    if "dpo" in sections:
        return "dpo"
    if "reward" in sections:
        return "rm"
    if "embed" in sections:
        return "embed"
    return "grpo" if "grpo" in sections else "sft"


def recipe_name(cfg: RecipeConfig) -> str:
    """The recipe a loaded config is for, by its schema."""
    return next(name for name, schema in SCHEMAS.items() if type(cfg) is schema)


def check_recipe_name(name: str) -> str:
    if name not in SCRIPTS:
        raise UserError(f"recipe {name}: not one of {', '.join(SCRIPTS)}")
    return name


def load_recipe_config(name: str, path: str | Path | None, overrides: list[str]) -> RecipeConfig:
    """The config as recipe `name` itself reads it: its schema, its default demo, its own checks."""
    if check_recipe_name(name) == "dpo":
        return load_preference_config(path, overrides)
    if name == "grpo":
        return load_grpo_config(path, overrides)
    if name == "rm":
        return load_reward_config(path, overrides)
    if name == "embed":
        return load_embed_config(path, overrides)
    return load_config(path, overrides)


def load_any_recipe_config(path: str | Path | None) -> RecipeConfig:
    """A saved or shipped config with the schema of the recipe it is for; only the checks every recipe
    shares are run (a finished run's reward files or adapters need not exist any more)."""
    return load_config(path, schema=SCHEMAS[recipe_of(path)])
