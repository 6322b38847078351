"""The launch's mesh (tensor parallel, FSDP x TP, HSDP): sizes, the data-parallel split of the global batch,
the one-line refusals, and which layers tensor parallelism splits."""

from pathlib import Path

import pytest
from helpers import REPO, tiny_llama_config, write_yaml
from peft import get_peft_model
from transformers import GPT2Config, LlamaForCausalLM

from toolkit.config import LoraConfig, ModelConfig, RecipeConfig, TrainConfig
from toolkit.errors import UserError
from toolkit.launch import checks, request
from toolkit.launch.machine import Machine
from toolkit.launch.mesh import Mesh, check_mesh
from toolkit.model import tensor_parallel
from toolkit.model.facts import read_model_facts
from toolkit.model.load import peft_config

CPU = Machine()


def recipe(model: ModelConfig | None = None, **lora) -> RecipeConfig:
    train = TrainConfig(global_batch_size=16, micro_batch_size=2)
    return RecipeConfig(model=model or ModelConfig(), lora=LoraConfig(**lora), train=train)


def check(path: Path, cfg: RecipeConfig, processes: int | None = None) -> list[str]:
    launch = checks.launch_from_yaml(path, 0, processes)
    return checks.check_launch(launch, cfg, read_model_facts(cfg.model), "recipe.yaml", CPU, {})


def config_dir(tmp_path: Path, config) -> ModelConfig:
    config.save_pretrained(tmp_path)
    return ModelConfig(path=str(tmp_path))


def test_mesh_sizes_and_data_parallel_split():
    assert Mesh.of({}, 4, fsdp=True) == Mesh(dp_shard=4)
    assert Mesh.of({}, 2, fsdp=False) == Mesh(dp_replicate=2)
    mesh = Mesh.of({"dp_shard": 2, "tp": 2}, 4, fsdp=True)
    assert (mesh.data_parallel, mesh.size, mesh.describe("fsdp2")) == (2, 4, "fsdp2 2 x tp 2")
    # tp is innermost: ranks 0 and 1 share the first data-parallel batch
    assert [mesh.data_rank(rank) for rank in range(4)] == [0, 0, 1, 1]
    assert Mesh(dp_replicate=2, dp_shard=2).describe("fsdp2") == "hsdp 2 x 2"
    assert Mesh(dp_shard=4).describe("fsdp2") == ""


@pytest.mark.parametrize(
    "name, backend_name, split",
    [
        ("tp", "tp 2", "GA 8 x data-parallel 1 (world 2 / tp 2)"),
        ("fsdp_tp", "fsdp2 2 x tp 2", "GA 4 x data-parallel 2 (world 4 / tp 2)"),
        ("hsdp", "hsdp 2 x 2", "GA 2 x world 4"),
    ],
)
def test_shipped_meshes_split_the_global_batch_over_data_parallel_processes(name, backend_name, split):
    launch = checks.launch_from_yaml(REPO / "accelerate_configs" / f"{name}.yaml", 0)
    assert request.backend_name(launch) == backend_name
    ga = {"tp": 8, "fsdp_tp": 4, "hsdp": 2}[name]
    assert f"GA {ga} x {request.batch_split(launch)}" == split
    assert check(REPO / "accelerate_configs" / f"{name}.yaml", recipe()) == []


def test_sizes_that_do_not_multiply_to_the_processes_are_refused():
    with pytest.raises(UserError, match=r"tp.yaml: .* = 2, but 4 processes are launched: make them multiply"):
        check(REPO / "accelerate_configs" / "tp.yaml", recipe(), processes=4)


@pytest.mark.parametrize(
    "backend_type, version, message",
    [
        ("deepspeed", 0, "under DeepSpeed is refused"),
        ("fsdp", 1, "needs fsdp_version: 2"),
        ("ddp", 0, "needs distributed_type: FSDP"),
    ],
)
def test_meshes_a_backend_cannot_train_are_refused(backend_type, version, message):
    with pytest.raises(UserError, match=message):
        check_mesh(Mesh(dp_replicate=2, tp=2), 4, version, backend_type, "x.yaml")


def test_a_model_without_a_tensor_parallel_plan_is_refused_in_one_line(tmp_path):
    model = config_dir(tmp_path, GPT2Config(n_layer=2, n_embd=32, n_head=4))
    with pytest.raises(UserError) as caught:
        check(REPO / "accelerate_configs" / "tp.yaml", recipe(model))
    message = str(caught.value)
    assert "\n" not in message and "model type gpt2 has no tensor-parallel plan" in message
    assert str(tmp_path) in message


def test_heads_that_do_not_divide_are_named(tmp_path):
    model = config_dir(tmp_path, tiny_llama_config(num_attention_heads=4, num_key_value_heads=1))
    with pytest.raises(
        UserError, match="num_key_value_heads 1 is not divisible by the tensor-parallel size 2"
    ):
        check(REPO / "accelerate_configs" / "fsdp_tp.yaml", recipe(model))


@pytest.mark.parametrize(
    "model, lora, key",
    [
        (ModelConfig(method="qlora"), {}, "model.method qlora"),
        (ModelConfig(), {"use_dora": True}, "lora.use_dora"),
    ],
)
def test_methods_that_cannot_be_split_are_refused(model, lora, key):
    with pytest.raises(UserError, match=f"tensor parallelism \\(tp 2\\) refuses {key}"):
        check(REPO / "accelerate_configs" / "tp.yaml", recipe(model, **lora))


def test_layers_split_with_their_adapter_pieces_and_the_head_stays_whole():
    config = tiny_llama_config()
    base = LlamaForCausalLM(config)
    model = get_peft_model(base, peft_config(LoraConfig(target_modules="all-linear"), base))
    styles = tensor_parallel.split_styles(model, config.base_model_tp_plan)
    layer = "base_model.model.model.layers.1"
    assert styles[f"{layer}.self_attn.q_proj.base_layer"] == "colwise"
    assert styles[f"{layer}.self_attn.q_proj.lora_B.default"] == "colwise"
    assert styles[f"{layer}.self_attn.o_proj.lora_A.default"] == "rowwise"
    assert styles[f"{layer}.mlp.down_proj.base_layer"] == "rowwise"
    assert f"{layer}.self_attn.q_proj.lora_A.default" not in styles  # its input is whole on every rank
    assert not [name for name in styles if "lm_head" in name or "embed" in name or "norm" in name]
    assert len(styles) == 2 * 7 * 2  # 2 layers x 7 linears x (layer + one adapter piece)


def test_a_user_yaml_of_the_same_shape_runs_as_the_shipped_one(tmp_path):
    """As `accelerate config` writes it: FSDP2 with a parallelism_config section."""
    path = write_yaml(
        tmp_path,
        {
            "distributed_type": "FSDP",
            "num_processes": 4,
            "fsdp_config": {"fsdp_version": 2},
            "parallelism_config": {"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 2},
        },
    )
    launch = checks.launch_from_yaml(path, 0)
    assert (launch.backend, launch.mesh) == ("fsdp", Mesh(dp_shard=2, tp=2))


def test_plain_fsdp_written_as_a_mesh_is_plain_fsdp(tmp_path):
    """dp_shard alone: the mesh accelerate is given (on CPU too), and the name and batch split of fsdp."""
    path = write_yaml(
        tmp_path,
        {
            "distributed_type": "FSDP",
            "num_processes": 2,
            "fsdp_config": {"fsdp_version": 2},
            "parallelism_config": {"parallelism_config_dp_shard_size": 2},
        },
    )
    launch = checks.launch_from_yaml(path, 0)
    assert launch.uses_mesh and launch.mesh == Mesh(dp_shard=2)
    assert (request.backend_name(launch), request.batch_split(launch)) == ("fsdp2", "world 2")
