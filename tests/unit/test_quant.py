"""QLoRA's 4-bit base on this CPU: the widths bitsandbytes' kernel takes, the storage dtype sharding needs,
and evaluation between training steps leaving the gradients as they were."""

import json
import re
from importlib.resources import files
from pathlib import Path

import pytest
import torch
import transformers

from toolkit.config import LoraConfig, ModelConfig
from toolkit.errors import UserError
from toolkit.model import quant
from toolkit.model.facts import read_model_facts
from toolkit.model.load import load_model
from toolkit.plan.estimate import make_plan
from toolkit.plan.request import PlanRequest

ASSETS = str(files("toolkit") / "assets")
Q64, TINY = f"{ASSETS}/tiny-llama-q64", f"{ASSETS}/tiny-llama"
LLAMA3_70B = {  # its config.json's widths
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}


def widths(path):
    with open(f"{path}/config.json") as file:
        return quant.layer_widths(json.load(file))


def test_the_qlora_model_meets_the_kernel_and_the_demo_model_fails_on_its_hidden_size():
    assert quant.width_problem(widths(Q64)) is None
    assert quant.width_problem(quant.layer_widths(LLAMA3_70B)) is None
    assert quant.width_problem(widths(TINY)) == "hidden_size 160 is not a multiple of the 4-bit block size 64"


@pytest.mark.parametrize(
    ("changed", "problem"),
    [
        ({"intermediate_size": 96}, "intermediate_size 96 is not a multiple of the 4-bit block size 64"),
        ({"num_key_value_heads": 1, "head_dim": 48}, "num_attention_heads x head_dim 96 is not a multiple"),
        (
            {"num_key_value_heads": 1, "head_dim": 80, "num_attention_heads": 4},
            "num_key_value_heads x head_dim 80",
        ),
    ],
)
def test_each_width_is_named_when_the_kernel_cannot_take_it(changed, problem):
    config = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, **changed}
    assert quant.width_problem(quant.layer_widths(config)).startswith(problem)


def test_storage_must_be_the_dtype_the_backend_casts_parameters_to():
    assert quant.cast_dtype("fsdp", 2, "bf16") == quant.cast_dtype("deepspeed", 0, "bf16") == "bfloat16"
    assert quant.cast_dtype("fsdp", 2, "no") is None  # FSDP2 without mixed precision keeps float32
    assert quant.cast_dtype("ddp", 0, "bf16") is None  # autocast casts activations, not parameters
    assert quant.storage_name("auto", "bfloat16") == "bfloat16"
    assert quant.storage_name("auto", None) == "float32"
    assert quant.storage_problem("bfloat16", "bfloat16", "fsdp2") is None
    assert quant.storage_problem("float32", None, "ddp") is None
    assert quant.storage_problem("float32", "bfloat16", "fsdp2") == (
        "model.quant_storage float32 != bfloat16, the dtype fsdp2 casts every parameter to: "
        "set model.quant_storage: auto (or bfloat16)"
    )


def test_fsdp1_names_the_setting_that_breaks_4bit_weights_first():
    assert quant.fsdp1_problem({"use_orig_params": "false"}).startswith("fsdp_use_orig_params false")
    loading = {"cpu_ram_efficient_loading": "true", "use_orig_params": "true"}
    assert quant.fsdp1_problem(loading).startswith("fsdp_cpu_ram_efficient_loading true")
    assert quant.fsdp1_problem({}) == "FSDP1 QLoRA is not proven here"


def test_loading_qlora_on_the_demo_model_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"^model.path: .*tiny-llama: hidden_size 160 is not a multiple"):
        load_model(ModelConfig(path=TINY, method="qlora"), LoraConfig())


def adapter_gradients(model, ids):
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


def test_an_evaluation_between_training_steps_leaves_the_gradients_unchanged():
    torch.manual_seed(0)
    model = load_model(ModelConfig(path=Q64, method="qlora"), LoraConfig(r=4))
    for name, p in model.named_parameters():  # a trained adapter, so gradients reach every layer
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    ids = torch.randint(0, 2000, (2, 12))
    model.train()
    before = adapter_gradients(model, ids)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    model.train()
    torch.testing.assert_close(adapter_gradients(model, ids), before, rtol=0, atol=0)


def saved_for_backward(method: str):
    """A bf16 model's hidden states' dtypes and the fp32 bytes its forward keeps for backward (under bf16
    autocast, as the recipes train)."""
    torch.manual_seed(0)
    model = load_model(ModelConfig(path=Q64, method=method, dtype="bfloat16"), LoraConfig(r=4))
    model.train()
    fp32 = []

    def keep(tensor):
        if tensor.dtype == torch.float32:
            fp32.append(tensor.numel() * 4)
        return tensor

    ids = torch.randint(0, 2000, (2, 64))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), torch.autocast("cpu", torch.bfloat16):
        out = model(input_ids=ids, output_hidden_states=True)
    return {h.dtype for h in out.hidden_states}, sum(fp32), model


def test_a_bf16_qlora_model_keeps_its_activations_in_bf16_like_lora():
    """peft's upcast would make the residual stream fp32, and 4-bit layers return their input's dtype: on a
    GPU that cost QLoRA 28% more memory than LoRA. The norms and embeddings stay bf16; adapters are fp32."""
    dtypes, fp32_kept, model = saved_for_backward("qlora")
    lora_dtypes, lora_fp32_kept, _ = saved_for_backward("lora")
    assert dtypes == lora_dtypes == {torch.bfloat16}
    assert fp32_kept == lora_fp32_kept  # the norms' fp32 internals and the adapters' inputs, alike
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    frozen_float = {p.dtype for n, p in model.named_parameters() if "norm" in n or "embed" in n}
    assert (trained, frozen_float) == ({torch.float32}, {torch.bfloat16})


def test_a_4bit_model_counts_the_flops_of_its_unpacked_weights():
    """MFU under QLoRA counts the multiplications by each weight, not by its packed bytes (a GPU run read
    0.07 against LoRA's 0.20 at 0.86 of its speed)."""
    from toolkit.model.flops import ModelShape

    shapes = [
        ModelShape.of(load_model(ModelConfig(path=Q64, method=m), LoraConfig(r=4))) for m in ("lora", "qlora")
    ]
    assert shapes[1] == shapes[0] and shapes[0].matmul_frozen > 0


def test_packed_weights_are_told_apart_by_shape_and_by_module():
    model = load_model(ModelConfig(path=Q64, method="qlora"), LoraConfig(r=4))
    packed = quant.packed_names(model)
    assert len(packed) == 14  # 7 linear layers in each of 2 blocks; the tied output head stays as it is
    unquantized = load_model(ModelConfig(path=Q64, method="lora"), LoraConfig(r=4))
    shapes = {name: tuple(p.shape) for name, p in unquantized.named_parameters()}
    assert quant.packed_keys(dict(model.named_parameters()), shapes) == packed


def test_the_70b_qlora_config_passes_the_launch_checks_on_two_4090s_and_the_plan_fits_it():
    from toolkit.config import load_config
    from toolkit.launch.checks import check_launch, launch_from_yaml
    from toolkit.launch.machine import Machine
    from toolkit.plan import architectures

    repo = Path(ASSETS).parent.parent
    cfg = load_config(repo / "recipes" / "configs" / "llama3-70b-qlora.yaml")
    assert cfg.model.method == "qlora" and cfg.model.gradient_checkpointing is True
    assert quant.width_problem(quant.layer_widths(architectures.lookup(cfg.model.path))) is None
    box = Machine(gpu_count=2, gpu_names=("NVIDIA GeForce RTX 4090",) * 2, gpu_mem_gib=24, p2p=False)
    launch = launch_from_yaml(repo / "accelerate_configs" / "zero3_offload.yaml", box.gpu_count)
    check_launch(launch, cfg, read_model_facts(cfg.model), "llama3-70b-qlora.yaml", box, {})
    plan = make_plan(PlanRequest(model=cfg.model.path, gpus=2, gpu_mem=24.0, method="qlora"))
    assert plan.choice.backend == "zero3_offload" and plan.choice.checkpointing
    assert "--config recipes/configs/llama3-70b-qlora.yaml" in plan.command


def test_the_qlora_model_is_small_and_its_script_rebuilds_it(tmp_path):
    import importlib.util

    from safetensors.torch import load_file

    script = Path(ASSETS).parent.parent / "scripts" / "build_qlora_asset.py"
    spec = importlib.util.spec_from_file_location("build_qlora_asset", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build(tmp_path / "rebuilt")
    shipped = load_file(f"{Q64}/model.safetensors")
    assert (Path(Q64) / "model.safetensors").stat().st_size < 512 * 1024
    rebuilt = load_file(tmp_path / "rebuilt" / "model.safetensors")
    assert rebuilt.keys() == shipped.keys()
    # The seeded initialisation differs in its last bits between CPU kernel sets: torch's normal_ has a
    # vectorised and a scalar path (other log and cos), each value off by a few float32 steps of the
    # spread's scale (initializer_range, 0.02; 32 steps of float32's eps, 7.6e-8, at most), and stored in
    # bfloat16, rounded to the nearest of its numbers (one bfloat16 step of the value). Measured under
    # ATEN_CPU_CAPABILITY=default on an AVX-512 CPU: 2 of 8192 values of a tensor 3.0e-8 apart.
    spread = transformers.LlamaConfig.from_pretrained(Q64).initializer_range
    for name, tensor in shipped.items():
        torch.testing.assert_close(
            rebuilt[name],
            tensor,
            rtol=torch.finfo(torch.bfloat16).eps,
            atol=spread * 32 * torch.finfo(torch.float32).eps,
            msg=name,
        )
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert unstamped(tmp_path / "rebuilt" / name) == unstamped(Path(Q64) / name), name


def unstamped(path: Path) -> str:
    """A saved file's text less the transformers version it is stamped with (a newer release rewrites it)."""
    return re.sub(r'\n *"transformers_version": "[^"]*",?', "", path.read_text())


def test_check_config_refuses_a_storage_dtype_fsdp2_would_corrupt_in_one_line(tmp_path, capsys):
    from toolkit.commands.cli import main as cli

    repo = Path(ASSETS).parent.parent
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model:\n  path: {Q64}\n  method: qlora\n  quant_storage: float32\ntrain:\n  mixed_precision: bf16\n"
    )
    assert cli(["check-config", str(repo / "accelerate_configs" / "fsdp.yaml"), "--config", str(recipe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"ftkit check-config: error: {recipe}: model.quant_storage float32 != bfloat16, the dtype fsdp2 "
        "casts every parameter to: set model.quant_storage: auto (or bfloat16)"
    ]


def test_the_plan_names_the_loading_peak_of_a_sharded_qlora_run():
    from toolkit.plan.memory import QLORA_BYTES_PER_PARAM
    from toolkit.plan.report import render_text

    plan = make_plan(PlanRequest(model="meta-llama/Meta-Llama-3-70B", gpus=2, gpu_mem=24.0, method="qlora"))
    c = plan.counts
    load = (c.quantizable * QLORA_BYTES_PER_PARAM + 2 * (c.frozen - c.quantizable)) / 2**30
    assert 36 < load < 38  # 68.7B weights at 4.13 bits, 2.1B embedding and head weights at 16
    assert f"whole 4-bit base ({load:.1f} GiB; does not fit in 24 GiB)" in render_text(plan)
    lora = make_plan(PlanRequest(model="meta-llama/Meta-Llama-3-8B", gpus=2, gpu_mem=24.0, method="lora"))
    assert "4-bit base" not in render_text(lora)
