"""Launch detection, the launch checker, and what the Accelerator is given, in one process."""

import json
import re
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from accelerate.commands.config import load_config_from_file
from accelerate.utils import DistributedType
from helpers import DS_RECIPE_KEYS, REPO, write_yaml

from toolkit.commands.cli import main as cli
from toolkit.config import RecipeConfig, TrainConfig
from toolkit.errors import UserError
from toolkit.launch import backend, checks
from toolkit.launch.backend import detect_launch
from toolkit.launch.machine import Machine
from toolkit.launch.request import Launch, backend_name, batch_split
from toolkit.model.facts import read_model_facts as facts_of

ACCEL_CONFIGS = sorted((REPO / "accelerate_configs").rglob("*.yaml"))
DS_CONFIGS = sorted((REPO / "ds_configs").rglob("*.json"))
RECIPE = "recipe.yaml"
CPU = Machine()
TWO_A100 = Machine(gpu_count=2, gpu_names=("NVIDIA A100-SXM4-80GB",) * 2)
# Each shipped accelerate config: the backend it starts, and its ZeRO stage or FSDP version.
SHIPPED = {
    "single": ("single", 0),
    "ddp": ("ddp", 0),
    "fsdp": ("fsdp", 2),
    "zero1": ("deepspeed", 1),
    "zero2": ("deepspeed", 2),
    "zero3": ("deepspeed", 3),
    "zero3_offload": ("deepspeed", 3),
    "multinode_ddp": ("ddp", 0),
    "multinode_zero3": ("deepspeed", 3),
    "tp": ("tp", 2),
    "fsdp_tp": ("fsdp", 2),
    "hsdp": ("fsdp", 2),
    # Plain multi-process launches: the recipe's pipeline.size makes them pipelines (test_pipeline_launch).
    "pp": ("ddp", 0),
    "pp_ddp": ("ddp", 0),
    "ep": ("ddp", 0),
    "sp": ("deepspeed", 2),
    "sp_dp": ("deepspeed", 3),
    "sp_zero3": ("deepspeed", 3),
}


def recipe(**train) -> RecipeConfig:
    """A recipe config every shipped launch divides evenly: 16 = 2 x GA x (1, 2 or 4 processes)."""
    return RecipeConfig(train=TrainConfig(**{"global_batch_size": 16, "micro_batch_size": 2, **train}))


def ds_yaml(tmp_path: Path, ds_json: dict, **extra) -> Path:
    json_path = tmp_path / "ds.json"
    json_path.write_text(json.dumps(ds_json))
    section = {"deepspeed_config_file": str(json_path), **extra.pop("deepspeed_config", {})}
    return write_yaml(
        tmp_path, {"distributed_type": "DEEPSPEED", "num_processes": 2, "deepspeed_config": section, **extra}
    )


def check(path: Path, cfg: RecipeConfig | None = None, machine: Machine = CPU, env: dict | None = None):
    launch = checks.launch_from_yaml(path, machine.gpu_count)
    cfg = cfg or recipe()
    return checks.check_launch(launch, cfg, facts_of(cfg.model), RECIPE, machine, {} if env is None else env)


# --- the shipped configs -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ACCEL_CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize(
    "machine", [CPU, Machine(gpu_count=4, gpu_names=("NVIDIA H100",) * 4)], ids=["cpu", "gpu"]
)
def test_shipped_accelerate_configs_load_and_pass_the_checker(path, machine, monkeypatch):
    monkeypatch.chdir(REPO)  # deepspeed_config_file is relative to where accelerate launch runs
    assert load_config_from_file(str(path)).mixed_precision is None, "precision belongs to the recipe config"
    raw = yaml.safe_load(path.read_text())
    launch = checks.launch_from_yaml(path.relative_to(REPO), machine.gpu_count)
    assert (launch.backend, launch.zero_stage or launch.fsdp_version) == SHIPPED[path.stem]
    assert launch.world_size == raw.get("num_processes", 1) and launch.on_cpu == (machine.gpu_count == 0)
    assert checks.check_launch(launch, recipe(), facts_of(recipe().model), RECIPE, machine, {}) == []
    if launch.backend == "deepspeed":
        assert (REPO / launch.ds_config_file).is_file()


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.name)
def test_shipped_deepspeed_configs_leave_every_recipe_field_to_the_recipe(path):
    config = json.loads(path.read_text())
    for key in DS_RECIPE_KEYS:
        assert config[key] == "auto", key
    assert config["fp16"]["enabled"] == config["bf16"]["enabled"] == "auto"
    assert "optimizer" not in config and "scheduler" not in config
    zero = config["zero_optimization"]
    assert zero["stage"] == int(path.stem[4])
    if zero["stage"] == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    offloaded = {zero.get(k, {}).get("device") for k in ("offload_optimizer", "offload_param")}
    assert offloaded == ({"cpu"} if "offload" in path.stem else {None})


def test_every_shipped_deepspeed_config_is_used_by_a_yaml():
    used = {
        yaml.safe_load(p.read_text()).get("deepspeed_config", {}).get("deepspeed_config_file")
        for p in ACCEL_CONFIGS
    }
    assert {str(p.relative_to(REPO)) for p in DS_CONFIGS} <= used


# --- reading the launch from the environment -----------------------------------------------------------


def torchrun_env(world: int = 2, **extra) -> dict:
    return {
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "ACCELERATE_MIXED_PRECISION": "no",
        **extra,
    }


def test_detect_launch_reads_what_accelerate_launch_sets():
    assert backend.detect_launch({}, gpu_count=0) == Launch("single", 1, 1, on_cpu=True)
    ddp = backend.detect_launch(torchrun_env(4, LOCAL_WORLD_SIZE="2"), gpu_count=2)
    assert (ddp.backend, ddp.world_size, ddp.procs_per_node, ddp.on_cpu) == ("ddp", 4, 2, False)
    fsdp = backend.detect_launch(torchrun_env(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2"), gpu_count=0)
    assert (fsdp.backend, fsdp.fsdp_version) == ("fsdp", 2)
    native = backend.detect_launch(
        torchrun_env(
            ACCELERATE_USE_DEEPSPEED="true",
            ACCELERATE_DEEPSPEED_ZERO_STAGE="3",
            ACCELERATE_GRADIENT_ACCUMULATION_STEPS="4",
        ),
        gpu_count=0,
    )
    assert (native.backend, native.zero_stage) == ("deepspeed", 3)
    assert native.ds_settings == {"zero_stage": "3", "gradient_accumulation_steps": "4"}


def test_detect_launch_reads_the_deepspeed_json(monkeypatch):
    monkeypatch.chdir(REPO)
    env = torchrun_env(
        ACCELERATE_USE_DEEPSPEED="true",
        ACCELERATE_DEEPSPEED_CONFIG_FILE="ds_configs/zero3.json",
        ACCELERATE_CONFIG_DS_FIELDS="deepspeed_config_file,zero3_init_flag",
    )
    launch = backend.detect_launch(env, gpu_count=0)
    assert (launch.zero_stage, launch.ds_settings, launch.launcher_precision) == (3, {}, "")
    env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = "ds_configs/nope.json"
    with pytest.raises(UserError, match="DeepSpeed config ds_configs/nope.json .* not found"):
        backend.detect_launch(env, gpu_count=0)


def test_detect_launch_sees_precision_given_to_the_launcher():
    assert backend.detect_launch(torchrun_env(ACCELERATE_MIXED_PRECISION="bf16")).launcher_precision == "bf16"
    refused = torchrun_env(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_CONFIG_DS_FIELDS="mixed_precision")
    assert backend.detect_launch(refused, gpu_count=0).launcher_precision == "no"
    with pytest.raises(UserError, match="Megatron-LM"):
        backend.detect_launch({"ACCELERATE_USE_MEGATRON_LM": "true"})


# --- what the Accelerator is given, and what is accepted afterwards --------------------------------------


def test_accelerator_kwargs_run_gpu_backends_on_gloo_without_a_gpu(monkeypatch):
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # the FSDP plugin writes it; restored after
    train = TrainConfig(mixed_precision="bf16")
    ddp = backend.accelerator_kwargs(Launch("ddp", 2, 2, on_cpu=True), train, grad_accum_steps=4)
    assert ddp["cpu"] is True and ddp["mixed_precision"] == "bf16"
    plugin = ddp["gradient_accumulation_plugin"]
    assert (plugin.num_steps, plugin.sync_with_dataloader) == (4, False)
    assert "cpu" not in backend.accelerator_kwargs(Launch("ddp", 2, 2, on_cpu=False), train, 4)
    fsdp = backend.accelerator_kwargs(Launch("fsdp", 2, 2, on_cpu=True, fsdp_version=2), train, 4)
    assert fsdp["cpu"] is True and fsdp["fsdp_plugin"].sync_module_states is not True
    fsdp1 = backend.accelerator_kwargs(Launch("fsdp", 2, 2, on_cpu=True, fsdp_version=1), train, 4)
    assert fsdp1["cpu"] is True and fsdp1["fsdp_plugin"].sync_module_states is False


@pytest.mark.parametrize("json_file", ["ds_configs/zero2.json", "ds_configs/zero3_offload.json", ""])
def test_deepspeed_auto_fields_come_from_the_recipe(json_file, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", json_file or "none")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("ACCELERATE_GRADIENT_CLIPPING", "1.0")  # a native YAML's value loses to the recipe's
    if json_file:  # beside a JSON, accelerate refuses native settings (the checker says so first)
        monkeypatch.delenv("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        monkeypatch.delenv("ACCELERATE_GRADIENT_CLIPPING")
    train = TrainConfig(global_batch_size=16, micro_batch_size=2, max_grad_norm=0.3)
    kwargs = backend.accelerator_kwargs(Launch("deepspeed", 2, 2, on_cpu=True), train, grad_accum_steps=4)
    config = kwargs["deepspeed_plugin"].deepspeed_config
    assert [config[k] for k in DS_RECIPE_KEYS] == [16, 2, 4, 0.3]
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert kwargs["kwargs_handlers"][0].backend == "gloo"


@pytest.mark.parametrize("name", ["ddp", "deepspeed"])
def test_collectives_time_out_after_twice_the_stall_timeout(name):
    train = TrainConfig(stall_timeout_minutes=7.5)
    kwargs = backend.accelerator_kwargs(Launch(name, 2, 2, on_cpu=True), train, grad_accum_steps=1)
    (group,) = kwargs["kwargs_handlers"]
    assert group.timeout == timedelta(minutes=15)


def stub_accelerator(num_processes: int, distributed_type: DistributedType):
    return SimpleNamespace(num_processes=num_processes, distributed_type=distributed_type)


def test_verify_refuses_processes_that_train_alone():
    launch = Launch("ddp", 2, 2, on_cpu=True)
    with pytest.raises(
        UserError, match="2 processes were launched .* joined 1 \\(NO\\): each process would train"
    ):
        backend.verify(stub_accelerator(1, DistributedType.NO), launch)
    with pytest.raises(UserError, match="asked for fsdp but accelerate set up MULTI_CPU"):
        backend.verify(stub_accelerator(2, DistributedType.MULTI_CPU), Launch("fsdp", 2, 2, on_cpu=True))
    backend.verify(stub_accelerator(2, DistributedType.MULTI_CPU), launch)
    backend.verify(stub_accelerator(2, DistributedType.MULTI_GPU), launch)
    backend.verify(stub_accelerator(1, DistributedType.NO), Launch("single", 1, 1, on_cpu=False))


def test_setup_returns_a_checked_accelerator_with_the_callers_options(tmp_path):
    single = Launch("single", 1, 1, on_cpu=True)
    accelerator = backend.setup(single, TrainConfig(), 4, project_dir=str(tmp_path))
    assert (accelerator.distributed_type, accelerator.gradient_accumulation_steps) == (DistributedType.NO, 4)
    assert accelerator.project_dir == str(tmp_path)
    with pytest.raises(UserError, match="2 processes were launched .* joined 1 \\(NO\\)"):
        backend.setup(Launch("ddp", 2, 2, on_cpu=True), TrainConfig(), 4)
    with pytest.raises(TypeError, match="mixed_precision"):
        backend.setup(single, TrainConfig(), 4, mixed_precision="bf16")


# --- the launch checker ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ds_json", "cfg", "message"),
    [
        (
            {"train_batch_size": 32},
            recipe(),
            "train_batch_size 32 in {json} != 16 (train.global_batch_size in recipe.yaml)",
        ),
        ({"train_micro_batch_size_per_gpu": 4}, recipe(), "train_micro_batch_size_per_gpu 4 in {json} != 2 "),
        (
            {"gradient_accumulation_steps": 8},
            recipe(),
            "gradient_accumulation_steps 8 in {json} != 4 "
            "(train.global_batch_size / (train.micro_batch_size x 2",
        ),
        ({"gradient_clipping": 1.0}, recipe(max_grad_norm=0.5), "gradient_clipping 1.0 in {json} != 0.5 "),
        (
            {"bf16": {"enabled": True}},
            recipe(),
            "bf16.enabled true in {json} != false (train.mixed_precision no",
        ),
        (
            {"fp16": {"enabled": False}},
            recipe(mixed_precision="fp16"),
            "fp16.enabled false in {json} != true ",
        ),
        ({"optimizer": {"type": "AdamW"}}, recipe(), "{json}: remove the optimizer block"),
        (
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
            recipe(),
            "parameter offload is ignored below ZeRO-3",
        ),
        (
            {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}},
            recipe(),
            "set zero_optimization.stage3_gather_16bit_weights_on_model_save to true",
        ),
    ],
)
def test_deepspeed_json_disagreeing_with_the_recipe_is_refused(tmp_path, ds_json, cfg, message):
    ds_json = {"zero_optimization": {"stage": 2}, **ds_json}
    path = ds_yaml(tmp_path, ds_json)
    with pytest.raises(UserError, match=re.escape(message.format(json=tmp_path / "ds.json"))):
        check(path, cfg, TWO_A100)


def test_deepspeed_json_with_matching_concrete_values_is_accepted(tmp_path):
    ds_json = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
    }
    assert check(ds_yaml(tmp_path, ds_json), recipe(mixed_precision="bf16"), TWO_A100) == []


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            {
                "distributed_type": "DEEPSPEED",
                "num_processes": 2,
                "deepspeed_config": {"deepspeed_config_file": "missing.json"},
            },
            "DeepSpeed config missing.json \\(deepspeed_config_file in .*accel.yaml\\) not found",
        ),
        (
            {
                "distributed_type": "MULTI_GPU",
                "num_processes": 2,
                "deepspeed_config": {"offload_optimizer_device": "cpu"},
            },
            "offload_optimizer_device in deepspeed_config is ignored by ddp",
        ),
        (
            {
                "distributed_type": "DEEPSPEED",
                "num_processes": 2,
                "fsdp_config": {"fsdp_offload_params": True},
            },
            "fsdp_offload_params in fsdp_config is ignored by deepspeed",
        ),
        ({"distributed_type": False}, "must be quoted as 'NO'"),
        ({"distributed_type": "MULTI_CPU", "num_processes": 2}, "MULTI_CPU is not supported"),
        ({"distributed_type": "MULTI_GPU"}, "num_processes is missing"),
        (
            {"distributed_type": "MULTI_GPU", "num_processes": 2, "mixed_precision": "bf16"},
            "mixed_precision bf16 in .*accel.yaml != no \\(train.mixed_precision in recipe.yaml\\)",
        ),
        (
            {
                "distributed_type": "DEEPSPEED",
                "num_processes": 2,
                "deepspeed_config": {"zero_stage": 2, "gradient_accumulation_steps": 1},
            },
            "gradient_accumulation_steps 1 in .*accel.yaml != 4",
        ),
    ],
)
def test_bad_accelerate_yaml_is_refused(tmp_path, content, message):
    with pytest.raises(UserError, match=message):
        check(write_yaml(tmp_path, content))


def test_accelerate_native_deepspeed_and_fsdp1_yaml_work_on_gpus(tmp_path):
    native = {
        "distributed_type": "DEEPSPEED",
        "num_processes": 2,
        "deepspeed_config": {
            "zero_stage": 3,
            "offload_param_device": "cpu",
            "gradient_accumulation_steps": 4,
            "gradient_clipping": 1.0,
            "zero3_init_flag": True,
        },
    }
    launch = checks.launch_from_yaml(write_yaml(tmp_path, native), gpu_count=2)
    assert (launch.zero_stage, backend_name(launch)) == (3, "deepspeed ZeRO-3 + offload")
    assert checks.check_launch(launch, recipe(), facts_of(recipe().model), RECIPE, TWO_A100, {}) == []
    fsdp1 = {
        "distributed_type": "FSDP",
        "num_processes": 2,
        "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"},
    }
    assert check(write_yaml(tmp_path, fsdp1), machine=TWO_A100) == []


def test_native_settings_beside_a_json_and_precision_beside_a_json_are_refused(tmp_path):
    with pytest.raises(UserError, match="zero_stage beside deepspeed_config_file are refused by accelerate"):
        check(ds_yaml(tmp_path, {"zero_optimization": {"stage": 2}}, deepspeed_config={"zero_stage": 2}))
    with pytest.raises(UserError, match="accelerate refuses it beside deepspeed_config_file"):
        check(ds_yaml(tmp_path, {"zero_optimization": {"stage": 2}}, mixed_precision="no"))


def test_deepspeed_not_installed_is_refused(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(backend, "deepspeed_installed", lambda: False)
    with pytest.raises(
        UserError, match="asks for DeepSpeed, which is not installed: pip install 'ftkit\\[deepspeed\\]'"
    ):
        check(REPO / "accelerate_configs/zero2.yaml")


def test_gpu_probes(tmp_path):
    ddp = REPO / "accelerate_configs/ddp.yaml"
    with pytest.raises(UserError, match="starts 2 processes per machine but 1 GPU\\(s\\) are visible"):
        check(ddp, machine=Machine(gpu_count=1, gpu_names=("NVIDIA A100",)))
    v100 = Machine(gpu_count=2, gpu_names=("Tesla V100-SXM2-32GB",) * 2, bf16=False)
    with pytest.raises(UserError, match="bf16 in recipe.yaml: Tesla V100-SXM2-32GB has no bf16, use fp16"):
        check(ddp, recipe(mixed_precision="bf16"), v100)
    assert check(ddp, recipe(mixed_precision="fp16"), v100) == []


@pytest.mark.parametrize(
    "config", ["zero2.yaml", "zero3.yaml", "zero3_offload.yaml", "multinode_zero3.yaml", "fsdp.yaml"]
)
def test_qlora_storage_must_survive_the_cast_of_fsdp2_and_deepspeed_under_bf16(config, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = recipe(mixed_precision="bf16")
    cfg.model.method, cfg.model.path = "qlora", "toolkit/assets/tiny-llama-q64"
    four = Machine(gpu_count=4, gpu_names=("NVIDIA A100",) * 4)
    assert check(Path("accelerate_configs") / config, cfg, four) == []
    cfg.model.quant_storage = "float32"
    with pytest.raises(UserError, match=r"model.quant_storage float32 != bfloat16, the dtype .* casts every"):
        check(Path("accelerate_configs") / config, cfg, four)
    # DDP's autocast never casts parameters: any storage dtype is right there.
    assert check(REPO / "accelerate_configs/ddp.yaml", cfg, TWO_A100) == []


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        ({"fsdp_use_orig_params": False}, "fsdp_use_orig_params false flattens the 4-bit weights"),
        ({"fsdp_cpu_ram_efficient_loading": True}, "fsdp_cpu_ram_efficient_loading true sends rank 0's"),
        ({}, "FSDP1 QLoRA is not proven here"),
    ],
)
def test_qlora_under_fsdp1_is_refused_naming_the_setting(settings, reason, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = recipe()
    cfg.model.method, cfg.model.path = "qlora", "toolkit/assets/tiny-llama-q64"
    fsdp1 = write_yaml(tmp_path, {"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": settings})
    with pytest.raises(UserError, match=f"qlora in recipe.yaml under FSDP1 .*: {re.escape(reason)}"):
        check(fsdp1, cfg, TWO_A100)


def test_qlora_on_a_model_whose_widths_the_4bit_kernel_cannot_take_is_refused_naming_the_width(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = recipe()
    cfg.model.method, cfg.model.path = "qlora", "toolkit/assets/tiny-llama"
    with pytest.raises(UserError, match="hidden_size 160 is not a multiple of the 4-bit block size 64"):
        check(REPO / "accelerate_configs/single.yaml", cfg, TWO_A100)
    cfg.model.method = "lora"
    assert check(REPO / "accelerate_configs/single.yaml", cfg, TWO_A100) == []


def test_fsdp_settings_come_from_the_launch_environment_as_from_the_yaml():
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "FSDP_USE_ORIG_PARAMS": "False"}
    assert detect_launch(env, gpu_count=0).fsdp_settings == {"use_orig_params": "False"}


def test_rtx_40xx_without_p2p_gets_nccl_p2p_and_ib_disabled_once():
    rtx = Machine(gpu_count=2, gpu_names=("NVIDIA GeForce RTX 4090",) * 2, p2p=False)
    env: dict = {}
    notes = check(REPO / "accelerate_configs/ddp.yaml", machine=rtx, env=env)
    assert env == {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
    assert len(notes) == 1 and "NCCL_P2P_DISABLE=1 and NCCL_IB_DISABLE=1" in notes[0]
    assert check(REPO / "accelerate_configs/ddp.yaml", machine=rtx, env=env) == []
    with_p2p = Machine(gpu_count=2, gpu_names=rtx.gpu_names, p2p=True)
    assert check(REPO / "accelerate_configs/ddp.yaml", machine=with_p2p, env={}) == []


def test_check_config_command(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert cli(["check-config", "accelerate_configs/zero3.yaml"]) == 0
    assert "accelerate_configs/zero3.yaml: ok: deepspeed ZeRO-3 on 2 process(es)" in capsys.readouterr().out
    recipe_yaml = tmp_path / "recipe.yaml"
    recipe_yaml.write_text("train:\n  global_batch_size: 8\n  micro_batch_size: 2\n")
    path = ds_yaml(tmp_path, {"train_batch_size": 32, "zero_optimization": {"stage": 2}})
    assert cli(["check-config", str(path), "--config", str(recipe_yaml)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"ftkit check-config: error: train_batch_size 32 in {tmp_path / 'ds.json'} != 8 "
        f"(train.global_batch_size in {recipe_yaml})"
    )


# --- pipelines: pipeline.size turns a plain multi-process launch into pp / pp x ddp ---------------------


def pipeline_recipe(size: int = 2, **keys) -> RecipeConfig:
    from toolkit.config import load_config

    return load_config(None, [f"pipeline.size={size}", *(f"{k}={v}" for k, v in keys.items())])


def pipeline_launch(yaml_name: str, cfg: RecipeConfig) -> Launch:
    launch = checks.launch_from_yaml(REPO / "accelerate_configs" / yaml_name, 0)
    return backend.with_pipeline(launch, cfg.pipeline.size, RECIPE)


def test_pipeline_size_makes_pp_and_pp_x_ddp_meshes():
    pp = pipeline_launch("pp.yaml", pipeline_recipe())
    assert (pp.backend, pp.mesh.pp, pp.mesh.data_parallel, pp.mesh.size) == ("pp", 2, 1, 2)
    both = pipeline_launch("pp_ddp.yaml", pipeline_recipe(**{"train.micro_batch_size": 4}))
    assert (both.backend, both.mesh.pp, both.mesh.data_parallel) == ("pp", 2, 2)
    # Ranks of one pipeline are neighbours and read the same batches.
    assert [both.mesh.data_rank(rank) for rank in range(4)] == [0, 0, 1, 1]
    assert backend_name(both) == "pp 2 x ddp 2"
    assert "data-parallel 2 (world 4 / pp 2)" in batch_split(both)
    assert backend.with_pipeline(pp, 1, RECIPE) is pp


@pytest.mark.parametrize(
    "yaml_name, size, message",
    [
        ("zero2.yaml", 2, "runs on a plain multi-process launch"),
        ("tp.yaml", 2, "runs on a plain multi-process launch"),
        ("pp.yaml", 4, "pipeline.size 4 does not divide the 2 launched"),
        ("single.yaml", 2, "does not divide the 1 launched"),
    ],
)
def test_pipeline_size_refuses_launches_it_cannot_run_on(yaml_name, size, message):
    with pytest.raises(UserError, match=message):
        pipeline_launch(yaml_name, pipeline_recipe(size))


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"model.method": "qlora"}, "refuses model.method qlora"),
        ({"train.mixed_precision": "fp16"}, "refuses train.mixed_precision fp16"),
        ({"train.activation_offload": True}, "refuses train.activation_offload"),
        ({"pipeline.schedule": "interleaved_1f1b"}, "interleaved_1f1b needs 2 or more chunks"),
        ({"pipeline.chunks_per_process": 2}, "interleaved_1f1b needs 2 or more chunks"),
        ({"train.micro_batch_size": 16}, "needs at least 2 micro-batches per step"),
        ({"pipeline.layers": "[1,2]"}, r"pipeline.layers \[1, 2\] gives 2 stages of 3 layers"),
        (
            {"pipeline.schedule": "interleaved_1f1b", "pipeline.chunks_per_process": 4},
            "4 decoder layers, fewer than 8",
        ),
    ],
)
def test_pipeline_checks_name_what_the_pipeline_refuses(keys, message):
    cfg = pipeline_recipe(**keys)
    with pytest.raises(UserError, match=message):
        checks.check_launch(pipeline_launch("pp.yaml", cfg), cfg, facts_of(cfg.model), RECIPE, CPU, {})


def test_a_pipeline_the_model_fits_passes_the_checks():
    cfg = pipeline_recipe(**{"pipeline.schedule": "interleaved_1f1b", "pipeline.chunks_per_process": 2})
    assert (
        checks.check_launch(pipeline_launch("pp.yaml", cfg), cfg, facts_of(cfg.model), RECIPE, CPU, {}) == []
    )


def test_check_config_says_a_pipeline_launch_without_pipeline_size_runs_as_ddp(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert cli(["check-config", "accelerate_configs/pp.yaml"]) == 0
    out = capsys.readouterr().out
    assert "ok: ddp on 2 process(es)" in out and "leaves pipeline.size at 1, so this runs as ddp" in out
    recipe_yaml = write_yaml(tmp_path, {"pipeline": {"size": 2}, "train": {"micro_batch_size": 4}})
    assert cli(["check-config", "accelerate_configs/pp.yaml", "--config", str(recipe_yaml)]) == 0
    out = capsys.readouterr().out
    assert "ok: pp 2 on 2 process(es)" in out and "runs as ddp" not in out
