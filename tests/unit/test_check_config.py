"""`ftkit check-config` knows which recipe a config is for and reads its data with that recipe's reader:
every shipped recipe config passes it. Configs naming a hub model or data set are checked with the embedded
tiny model and the embedded data of the same recipe in their place (nothing is downloaded here); every
other key is the shipped one."""

from pathlib import Path

import pytest
import yaml
from helpers import REPO
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from toolkit.commands.check_config import check_config_cli
from toolkit.errors import UserError
from toolkit.grpo.config import BUILT_IN_REWARDS
from toolkit.recipes import recipe_of

CONFIGS = sorted((REPO / "recipes" / "configs").rglob("*.yaml"))
ASSETS = REPO / "toolkit" / "assets"
EMBEDDED_DATA = {
    "sft": "demo/train.jsonl",
    "grpo": "demo/train.jsonl",
    "dpo": "demo/pairs_train.jsonl",
    "rm": "demo/pairs_train.jsonl",
    "embed": "demo/embed_train.jsonl",
}


def local(path: str) -> bool:
    return (REPO / path).exists()


def with_embedded_assets(path: Path, recipe: str, tmp_path: Path) -> Path:
    raw = yaml.safe_load(path.read_text())
    grpo = raw.get("grpo") or {}
    if grpo.get("rewards"):  # a reward model's folder from a run of the user's: a tiny one in its place
        grpo["rewards"] = [
            name if rule(name) else str(tiny_reward_model(tmp_path)) for name in grpo["rewards"]
        ]
    model = raw.setdefault("model", {})
    if not local(model.get("path", "toolkit/assets/tiny-llama")):
        # QLoRA's 4-bit kernel takes widths in multiples of 64: the embedded model made for it.
        tiny = "tiny-llama-q64" if model.get("method") == "qlora" else "tiny-llama"
        model["path"] = str(ASSETS / tiny)
    data = raw.setdefault("data", {})
    if not local(str(data.get("train", "toolkit/assets/demo/train.jsonl"))):
        data.update(train=str(ASSETS / EMBEDDED_DATA[recipe]), eval=None, split="train")
    for key in ("path", "adapter"):
        if model.get(key) and not Path(model[key]).is_absolute():
            model[key] = str(REPO / model[key]) if local(model[key]) else None
    for key in ("train", "eval"):
        if isinstance(data.get(key), str) and local(data[key]):
            data[key] = str(REPO / data[key])
    copy = tmp_path / path.name
    copy.write_text(yaml.safe_dump(raw))
    return copy


def rule(name: str) -> bool:
    """A built-in reward or one of the user's functions (module:function), not a reward model's folder."""
    return name in BUILT_IN_REWARDS or ":" in name


def tiny_reward_model(tmp_path: Path) -> Path:
    """A reward model's folder as recipes/reward_llm.py exports one merged: the embedded tiny model with a
    scalar head, and its tokenizer."""
    folder = tmp_path / "reward-model"
    if not folder.exists():
        config = AutoConfig.from_pretrained(ASSETS / "tiny-llama", num_labels=1)
        AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
        AutoTokenizer.from_pretrained(ASSETS / "tiny-llama").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_recipe_config_passes_check_config_with_its_own_recipe(path, tmp_path):
    recipe = recipe_of(path)
    report = check_config_cli(
        str(REPO / "accelerate_configs" / "ddp.yaml"),
        str(with_embedded_assets(path, recipe, tmp_path)),
        2,
        {},
    )
    assert f"ok: ddp on 2 process(es) as gloo CPU processes (no GPU here) for the {recipe} recipe" in report
    data_line = report.splitlines()[-1]
    if recipe in ("dpo", "rm"):
        assert data_line.startswith("preference pairs: the opening 8 records of each source read as")
    elif recipe == "embed":
        assert (
            data_line
            == "embedding triplets: the opening 8 records of each source read (1 hard negatives a row)"
        )
    else:
        assert data_line.startswith("chat template: generation prompts agree"), data_line


def test_a_config_naming_a_reward_model_of_a_run_checks_on_a_fresh_checkout(tmp_path):
    """A GRPO config whose rewards name a reward model trained by an earlier run (not in a fresh checkout):
    checked with a tiny reward model in its place, the rule reward kept."""
    shipped = yaml.safe_load((REPO / "recipes" / "configs" / "demo-grpo.yaml").read_text())
    shipped["grpo"]["rewards"] = ["exact_answer", "runs/demo-rm/final"]
    config = tmp_path / "shipped" / "grpo-with-rm.yaml"
    config.parent.mkdir()
    config.write_text(yaml.safe_dump(shipped))
    checked = with_embedded_assets(config, "grpo", tmp_path)
    rewards = yaml.safe_load(checked.read_text())["grpo"]["rewards"]
    assert rewards == ["exact_answer", str(tmp_path / "reward-model")]
    report = check_config_cli(str(REPO / "accelerate_configs" / "ddp.yaml"), str(checked), 2, {})
    assert "ok: ddp on 2 process(es)" in report and "for the grpo recipe" in report
    with pytest.raises(UserError, match="grpo.rewards: unknown reward 'runs/demo-rm/final'"):
        check_config_cli(str(REPO / "accelerate_configs" / "ddp.yaml"), str(config), 2, {})


def test_the_recipe_is_told_by_the_configs_sections():
    configs = REPO / "recipes" / "configs"
    assert [recipe_of(configs / f"{n}.yaml") for n in ("demo", "demo-dpo", "demo-grpo")] == [
        "sft",
        "dpo",
        "grpo",
    ]
    assert recipe_of(configs / "llama3-8b-dpo-lora.yaml") == "dpo" and recipe_of(None) == "sft"


def test_kto_reads_pairs_as_its_rows(tmp_path):
    config = tmp_path / "kto.yaml"
    demo = yaml.safe_load((REPO / "recipes" / "configs" / "demo-dpo.yaml").read_text())
    demo["model"].update(path=str(ASSETS / "tiny-llama"), adapter=None)
    demo["dpo"].update(loss="kto", sft_weight=None)
    demo["data"].update(train=str(ASSETS / "demo" / "pairs_train.jsonl"), eval=None)
    config.write_text(yaml.safe_dump(demo))
    report = check_config_cli(str(REPO / "accelerate_configs" / "ddp.yaml"), str(config), 2, {})
    assert report.splitlines()[-1].startswith(
        "preference pairs: the opening 8 records of each source read as explicit rows"
    )


def test_sft_data_given_to_the_dpo_recipe_is_one_line_naming_the_record(tmp_path):
    config = tmp_path / "dpo.yaml"
    demo = yaml.safe_load((REPO / "recipes" / "configs" / "demo-dpo.yaml").read_text())
    demo["model"].update(path=str(ASSETS / "tiny-llama"), adapter=None)
    demo["data"].update(train=str(ASSETS / "demo" / "train.jsonl"), eval=None)
    config.write_text(yaml.safe_dump(demo))
    with pytest.raises(UserError, match=r"train\.jsonl:1: keys \[.*\] are SFT data .* not preference pairs"):
        check_config_cli(str(REPO / "accelerate_configs" / "ddp.yaml"), str(config), 2, {})
