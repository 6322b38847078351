from pathlib import Path

import pytest
from helpers import REPO

import toolkit
from toolkit.config import DEMO_CONFIG, RecipeConfig, load_config
from toolkit.errors import UserError
from toolkit.train.batches import grad_accum_steps
from toolkit.typed_yaml import field_docs, flat_dict

# Preference, GRPO, reward-model and embedding configs have a section of their own: test_preference_config.py,
# test_grpo.py, test_reward.py, test_embed.py.
SHIPPED = sorted(
    p
    for p in (REPO / "recipes" / "configs").rglob("*.yaml")
    if not {"dpo", "grpo", "rm", "embed"} & set(p.stem.split("-"))
)


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_recipe_config_loads(path):
    cfg = load_config(path)
    assert cfg.model.method in ("full", "lora", "qlora")
    assert grad_accum_steps(cfg.train, 2) >= 1  # every shipped config runs on the 2-GPU target


def test_shipped_configs_include_the_promised_models():
    names = {p.name for p in SHIPPED}
    assert {"demo.yaml", "llama3-8b-lora.yaml", "qwen2.5-7b-lora.yaml"} <= names
    assert any(load_config(p).model.method == "full" for p in SHIPPED)


def test_no_config_means_demo():
    assert load_config(None) == load_config(REPO / "recipes" / "configs" / "demo.yaml")


def test_the_default_config_is_package_data_identical_to_the_recipes_demo():
    """Inside the package, so a non-editable install has it; byte for byte the user-facing file."""
    assert DEMO_CONFIG.is_relative_to(Path(toolkit.__file__).parent)
    assert DEMO_CONFIG.read_bytes() == (REPO / "recipes" / "configs" / "demo.yaml").read_bytes()


def test_the_preference_default_config_is_package_data_identical_to_the_recipes_demo():
    from toolkit.preference.config import DEMO_DPO_CONFIG

    assert DEMO_DPO_CONFIG.is_relative_to(Path(toolkit.__file__).parent)
    assert DEMO_DPO_CONFIG.read_bytes() == (REPO / "recipes" / "configs" / "demo-dpo.yaml").read_bytes()


def test_overrides_are_typed(tmp_path):
    cfg = load_config(
        write(tmp_path, "train:\n  max_steps: 3\n"),
        ["train.learning_rate=1e-3", "data.train=[a.jsonl, b.jsonl]", "lora.r=8", "model.path=x"],
    )
    assert cfg.train.learning_rate == 1e-3 and cfg.train.max_steps == 3
    assert cfg.data.train == ["a.jsonl", "b.jsonl"] and cfg.lora.r == 8 and cfg.model.path == "x"


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        ("train:\n  max_step: 3\n", [], "unknown key train.max_step (did you mean train.max_steps?)"),
        ("trian:\n  max_steps: 3\n", [], "unknown key trian (did you mean train?)"),
        ("", ["train.lerning_rate=1"], "did you mean train.learning_rate?"),
        ("train:\n  max_steps: ten\n", [], "train.max_steps has the wrong type: 'ten' is not int"),
        ("train:\n  max_steps: true\n", [], "train.max_steps has the wrong type"),
        ("model: lora\n", [], "model must be a mapping"),
        ("", ["train.learning_rate=0"], "train.learning_rate: must be positive"),
        ("", ["train.max_steps=-1"], "train.max_steps: must be positive"),
        (
            "",
            ["train.global_batch_size=10", "train.micro_batch_size=4"],
            "not a multiple of train.micro_batch_size",
        ),
        ("", ["model.method=prefix"], "model.method: 'prefix' is not one of full, lora, qlora"),
        ("", ["data.format=chatml"], "data.format: 'chatml' is not one of"),
        ("", ["train.max_steps"], "must look like key=value"),
        ("train: [1, 2\n", [], "not valid YAML"),
    ],
)
def test_bad_config_names_the_key(tmp_path, text, overrides, message):
    path = write(tmp_path, text)
    with pytest.raises(UserError) as info:
        load_config(path, overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        ("train:\n  bogus: 1\n", [], "FILE: unknown key train.bogus"),
        ("", ["train.bogus=1"], "command line: unknown key train.bogus"),
        ("train:\n  max_steps: abc\n", [], "FILE: train.max_steps has the wrong type: 'abc' is not int"),
        ("", ["train.max_steps=abc"], "command line: train.max_steps has the wrong type: 'abc' is not int"),
        ("train:\n  max_steps: 0\n", [], "FILE: train.max_steps: must be positive, got 0"),
        ("", ["train.max_steps=0"], "command line: train.max_steps: must be positive, got 0"),
        ("", ["train.adam_betas=[0.9, 1.5]"], "command line: train.adam_betas: item 1: must be in [0, 1)"),
        ("", ["train.adam_betas=[0.9, x]"], "command line: train.adam_betas[1] has the wrong type"),
        ("", ["train={bogus: 1}"], "command line: unknown key train.bogus"),
        ("", ["model=lora"], "command line: model must be a mapping, got str"),
        (
            "",
            ["model.method=full", "lora.init_adapter=a"],
            "command line: lora.init_adapter: a full fine-tune",
        ),
        ("lora:\n  init_adapter: a\n", ["model.method=full"], "FILE: lora.init_adapter: a full fine-tune"),
        # The command line set another key of the section: the mistake is still the file's.
        ("train:\n  bogus: 1\n", ["train.max_steps=5"], "FILE: unknown key train.bogus"),
        ("train:\n  max_steps: 0\n", ["train.learning_rate=0.1"], "FILE: train.max_steps: must be positive"),
    ],
)
def test_a_refused_key_names_where_it_was_set(tmp_path, text, overrides, message):
    path = write(tmp_path, text)
    with pytest.raises(UserError) as info:
        load_config(path, overrides)
    assert str(info.value).startswith(message.replace("FILE", str(path)))


def test_a_bad_file_value_the_command_line_replaces_is_no_error(tmp_path):
    cfg = load_config(write(tmp_path, "train:\n  max_steps: abc\n"), ["train.max_steps=5"])
    assert cfg.train.max_steps == 5


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_accumulation_is_derived_from_world_size():
    cfg = RecipeConfig().train
    cfg.global_batch_size, cfg.micro_batch_size = 16, 2
    assert [grad_accum_steps(cfg, world) for world in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(UserError, match="not divisible by train.micro_batch_size \\(2\\) x 3 processes"):
        grad_accum_steps(cfg, 3)


def test_every_key_is_documented():
    docs = field_docs(RecipeConfig)
    assert [key for key in flat_dict(RecipeConfig()) if not docs.get(key)] == []


def test_a_word_yaml_reads_as_a_boolean_keeps_its_meaning_where_a_key_takes_words():
    # YAML 1.1 reads `no` as false; train.mixed_precision's words include "no".
    assert load_config(None, ["train.mixed_precision=no"]).train.mixed_precision == "no"
    assert load_config(None, ["model.gradient_checkpointing=no"]).model.gradient_checkpointing is False
