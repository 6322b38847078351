"""Peer configs (tests/e2e/peer_configs/): each passes the launch check or is refused in one line naming the
file and key, and the check reads the same from the YAML (`ftkit check-config`) as from the environment
`accelerate launch` sets from that YAML (the recipe's launch check)."""

from dataclasses import replace
from pathlib import Path

import pytest
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env
from helpers import REPO

from toolkit.config import RecipeConfig, TrainConfig, load_config
from toolkit.errors import UserError
from toolkit.launch import backend, checks, deepspeed, request, sections
from toolkit.launch.machine import Machine
from toolkit.model.facts import read_model_facts

PEERS = REPO / "tests" / "e2e" / "peer_configs"
CPU = Machine()
# Each peer config -> None (passes with the recipe precision it asks for) or what its refusal must say.
EXPECTED = {
    "fsdp1": None,
    "fsdp1_full": None,
    "fsdp2": None,
    "zero2_concrete": None,
    "zero3_native": None,
    "zero3_alt_gather": None,
    "zero3_offload": None,
    "fsdp1_offload": "fsdp1_offload.yaml: fsdp_offload_params true moves parameters off a GPU",
    "fsdp1_wrong_layer": "Qwen3_5DecoderLayer is not a layer of toolkit/assets/tiny-llama: use Llama",
    "zero0": "zero0.json: zero_optimization.stage 0 is refused",
    "zero2_compile": "zero2_compile.json: the compile block is refused",
    "zero1_autotp": "zero1_autotp.json: tensor_parallel.autotp_size 2 is refused",
    "context_parallel": "context_parallel.yaml: parallelism_config_cp_size 2 is refused: context",
    "sequence_parallel": None,
    "accelerate_docs_sp": None,
}


def test_every_peer_config_has_an_expected_outcome():
    assert {p.stem for p in PEERS.glob("*.yaml")} == set(EXPECTED)


def recipe_for(path: Path) -> RecipeConfig:
    """The demo recipe with the e2e tests' batch, at the precision the YAML names (the override
    docs/backends.md names)."""
    precision = str(checks.read_yaml_mapping(path, "accelerate config").get("mixed_precision") or "no")
    demo = load_config(None, ["train.global_batch_size=8", "train.micro_batch_size=4"])
    return replace(demo, train=replace(demo.train, mixed_precision=precision))


def launched_env(path: Path) -> dict:
    """The environment `accelerate launch --config_file path` gives each process (torchrun adds the rest)."""
    args = launch_command_parser().parse_args(["--config_file", str(path), "recipes/finetune_llm.py"])
    args, _, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = []
        env = prepare_deepspeed_cmd_env(args)[1]
    else:
        env = prepare_multi_gpu_env(args)
    return {**env, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}


def outcome(launch: request.Launch, cfg: RecipeConfig) -> str | None:
    try:
        checks.check_launch(launch, cfg, read_model_facts(cfg.model), "recipe.yaml", CPU, {})
    except UserError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_peer_config_passes_or_is_refused_in_one_line(name, monkeypatch):
    monkeypatch.chdir(REPO)
    path = Path("tests/e2e/peer_configs") / f"{name}.yaml"
    from_yaml = outcome(checks.launch_from_yaml(path, gpu_count=0), recipe_for(path))
    if EXPECTED[name] is None:
        assert from_yaml is None
    else:
        assert from_yaml is not None and EXPECTED[name] in from_yaml and "\n" not in from_yaml


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_launch_check_agrees_with_check_config(name, monkeypatch):
    monkeypatch.chdir(REPO)
    path = Path("tests/e2e/peer_configs") / f"{name}.yaml"
    cfg = recipe_for(path)
    from_yaml = outcome(checks.launch_from_yaml(path, gpu_count=0), cfg)
    from_env = outcome(backend.detect_launch(launched_env(path), gpu_count=0), cfg)
    # The launched process cannot name the YAML it came from, only the launch environment.
    assert (from_env is None) == (from_yaml is None)
    if from_yaml is not None:
        assert from_env.replace(request.ENV_SOURCE, str(path)) == from_yaml


def test_yaml_precision_refusal_names_the_file_and_both_fixes(monkeypatch):
    monkeypatch.chdir(REPO)
    path = Path("tests/e2e/peer_configs/fsdp2.yaml")
    message = outcome(checks.launch_from_yaml(path, gpu_count=0), RecipeConfig())
    assert message.startswith(f"mixed_precision bf16 in {path} != no")
    assert "train.mixed_precision=bf16" in message and "--mixed_precision no" in message


def test_parallelism_sizes_above_one_are_refused_with_the_reason():
    with pytest.raises(UserError, match="x.yaml: parallelism_config_cp_size 2 is refused: "):
        sections.refuse_parallelism({"cp": 2}, "x.yaml")
    sections.refuse_parallelism({"dp_shard": 2, "cp": 1, "sp": 1, "tp": 1}, "x.yaml")  # plain FSDP is fine
    sections.refuse_parallelism({"dp_replicate": 2, "dp_shard": 2, "tp": 2}, "x.yaml")  # meshes run
    sections.refuse_parallelism({"sp": 2}, "x.yaml")  # sequence parallelism: see tests/unit/test_launch.py


def test_deepspeed_sections_refused_or_passed():
    zero = {"zero_optimization": {"stage": 2}}
    sections.refuse_deepspeed_sections(zero, 2, "ds.json")
    sections.refuse_deepspeed_sections({**zero, "compile": {"disable": True}}, 2, "ds.json")
    sections.refuse_deepspeed_sections({**zero, "tensor_parallel": {"autotp_size": 1}}, 2, "ds.json")
    with pytest.raises(UserError, match="compile block"):
        sections.refuse_deepspeed_sections({**zero, "compile": {"backend": "inductor"}}, 2, "ds.json")
    both = {"zero_optimization": {"stage": 3, **dict.fromkeys(sections.GATHER_KEYS, True)}}
    with pytest.raises(
        UserError, match="sets both stage3_gather_16bit_weights_on_model_save and gather_16bit"
    ):
        sections.refuse_deepspeed_sections(both, 3, "ds.json")


def test_the_plugin_fills_the_gather_field_under_the_users_spelling(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "tests/e2e/peer_configs/zero3_alt_gather.json")
    zero = deepspeed.deepspeed_plugin(TrainConfig(), 1).deepspeed_config["zero_optimization"]
    assert zero["gather_16bit_weights_on_model_save"] is True
    assert "stage3_gather_16bit_weights_on_model_save" not in zero


def test_wrap_classes_are_compared_with_the_models_own_layers():
    known = {"LlamaDecoderLayer", "LlamaAttention", "LlamaMLP"}
    sections.refuse_unknown_wrap_classes("LlamaDecoderLayer", known, "m", "f.yaml")
    sections.refuse_unknown_wrap_classes("Anything", None, "m", "f.yaml")  # the model's own code: unknown
    with pytest.raises(
        UserError, match="f.yaml: .*Qwen3DecoderLayer is not a layer of m: use LlamaDecoderLayer"
    ):
        sections.refuse_unknown_wrap_classes("LlamaDecoderLayer, Qwen3DecoderLayer", known, "m", "f.yaml")


def test_an_error_raised_inside_deepspeed_is_not_reported_as_the_models(tmp_path):
    from toolkit.model import load as model

    def raise_from(filename: str) -> ValueError:
        try:
            exec(compile("raise ValueError('bad config key')", filename, "exec"))
        except ValueError as exc:
            return exc

    assert model.raised_by_backend(raise_from("/site-packages/deepspeed/runtime/config.py"))
    assert not model.raised_by_backend(raise_from("/site-packages/transformers/modeling_utils.py"))
