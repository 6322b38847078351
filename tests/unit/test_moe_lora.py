"""LoRA's reach on a mixture of experts: the same parts on every family (peft alone adapts the router and
experts on some and not others), each part chosen by its key, and adapters that plain peft loads."""

import pytest
import torch
from helpers import TINY_MOE, tiny_moe, tiny_moe_config
from transformers import AutoModelForCausalLM

from toolkit.config import LoraConfig, ModelConfig
from toolkit.model import moe
from toolkit.model.load import _with_adapter, load_model

SHARED = {"qwen2_moe": "14,368", "granitemoeshared": "10,240"}  # its LoRA parameters at rank 16


def adapted(model_type: str, **lora):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_moe_config(model_type))
    return _with_adapter(base, LoraConfig(r=4, **lora))


@pytest.mark.parametrize("model_type", sorted(TINY_MOE))
def test_every_family_adapts_the_same_parts_and_each_key_turns_its_part_on_or_off(model_type):
    default = {"attention", "experts"} | ({"shared expert"} if model_type in SHARED else set())
    assert set(moe.trained_parts(adapted(model_type))) == default
    assert set(moe.trained_parts(adapted(model_type, router=True))) == default | {"router"}
    for key, part in (("experts", "experts"), ("attention", "attention"), ("shared_expert", "shared expert")):
        assert set(moe.trained_parts(adapted(model_type, **{key: False}))) == default - {part}, key


def test_the_fused_gate_and_up_projections_get_twice_the_rank_on_every_family():
    for model_type in ("gpt_oss", "qwen3_moe"):  # peft alone doubles it on the second only
        shapes = {n.split("layers.0.mlp.")[-1]: p.shape for n, p in adapted(model_type).named_parameters()}
        assert shapes["experts.base_layer.lora_A.default.weight"][0] == 2 * 4 * 4  # rank 2 x 4, 4 experts


def test_a_dense_mlp_layer_keeps_its_adapter_where_peft_would_convert_its_names(tmp_path):
    """Qwen3-MoE with a dense first layer: peft maps the names gate_proj/up_proj/down_proj onto the fused
    experts, so ftkit names that layer's weights as parameters; plain peft loads the adapter and computes the
    same logits."""
    from peft import PeftModel

    config = tiny_moe_config("qwen3_moe", mlp_only_layers=[0])
    model = adapted_model = _with_adapter(_seeded(config), LoraConfig(r=4, router=True))
    assert {"other", "router", "experts", "attention"} == set(moe.trained_parts(model))
    assert any("layers.0.mlp.gate_proj.lora_A" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()  # B starts at zero: give every adapter an effect
    ids = torch.arange(12).view(2, 6)
    adapted_model.eval()
    expected = adapted_model(input_ids=ids).logits
    adapted_model.save_pretrained(tmp_path / "adapter")
    plain = PeftModel.from_pretrained(_seeded(config), tmp_path / "adapter").eval()
    torch.testing.assert_close(plain(input_ids=ids).logits, expected)


def _seeded(config):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_experts_false_leaves_them_frozen_with_all_linear_too(tmp_path):
    path = str(tiny_moe(tmp_path / "moe"))
    model = load_model(ModelConfig(path=path, method="lora"), LoraConfig(experts=False))
    assert set(moe.trained_parts(model)) == {"attention"}


@pytest.mark.usefixtures("signal_handlers_restored")
@pytest.mark.parametrize("model_type", ["olmoe", "granitemoeshared"])  # the families no launched test runs
def test_a_family_trains_with_every_part_adapted_and_generates_from_adapter_and_merged_model(
    model_type, tmp_path, capsys
):
    from helpers import load_recipe

    from toolkit.commands.generate import generate_cli
    from toolkit.errors import run_main
    from toolkit.model.for_generation import load_for_generation
    from toolkit.train.metrics import read_metrics

    path = tiny_moe(tmp_path / model_type, model_type)
    argv = [f"model.path={path}", f"output_dir={tmp_path / 'run'}", "model.adapter=null", "lora.router=true"]
    argv += [
        "train.max_steps=2",
        "train.log_every_steps=1",
        "train.micro_batch_size=4",
        "data.max_length=48",
        "eval.max_batches=0",
    ]
    argv += ["eval.exact_match_samples=0", "export.merge=true", "train.learning_rate=1e-2"]
    assert run_main(load_recipe("finetune_llm").main, argv, "finetune_llm") == 0, capsys.readouterr().err
    shared = ", shared expert" if model_type in SHARED else ""
    out = capsys.readouterr().out
    trained = dict(p.rsplit(" ", 1) for p in out.split("; trained: ")[1].splitlines()[0].split(", "))
    shared = {"shared expert": SHARED[model_type]} if model_type in SHARED else {}
    assert trained == {"attention": "14,336", "experts": "45,056", "router": "2,176", **shared}
    logged = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [line["step"] for line in logged if "router_aux_loss" in line] == [1, 2]
    final = tmp_path / "run" / "final"
    ids = torch.arange(3, 15).view(2, 6)
    adapter, merged = (load_for_generation(d)[0] for d in (final, final / "merged"))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapter(input_ids=ids).logits)
        assert (merged(input_ids=ids).logits - adapter.get_base_model()(input_ids=ids).logits).abs().max() > 0
    answers = {generate_cli(str(d), "What is 2+3?", 4) for d in (final, final / "merged")}
    assert len(answers) == 1


def test_the_experts_kernel_is_chosen_by_key_and_computes_the_same(tmp_path):
    from toolkit.config import MoeConfig

    path = str(tiny_moe(tmp_path / "moe"))
    ids = torch.arange(3, 15).view(2, 6)
    logits = {}
    for kernel in ("grouped_mm", "batched_mm", "eager"):
        model = load_model(
            ModelConfig(path=path, method="full"),
            LoraConfig(),
            experts=MoeConfig(experts_implementation=kernel),
        )
        assert model.config._experts_implementation == kernel
        with torch.no_grad():
            logits[kernel] = model(input_ids=ids).logits
    torch.testing.assert_close(logits["batched_mm"], logits["grouped_mm"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits["eager"], logits["grouped_mm"], rtol=1e-5, atol=1e-5)
