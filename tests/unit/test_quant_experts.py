"""QLoRA keeps a mixture of experts' fused routed experts in 4-bit: stored as NF4 codes and block scales,
read dequantized a tensor at a time, with peft's LoRA term on top under the names LoRA has on the
unquantized model; the merged export folds the adapter into the experts as training saw them."""

import shutil

import pytest
import torch
from helpers import step_losses, tiny_moe
from peft import set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from toolkit.config import LoraConfig, ModelConfig
from toolkit.errors import run_main
from toolkit.model import quant, quant_experts
from toolkit.model.load import load_model, trainable_and_total

# Widths in multiples of 64, which bitsandbytes' CPU kernel takes for the attention's 4-bit layers.
WIDE = dict(num_key_value_heads=4, moe_intermediate_size=64, intermediate_size=64)
NF4_HALF_GAP = 0.14  # half the widest gap between NF4 levels (0.7230 to 1.0), a share of a block's absmax


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return tiny_moe(tmp_path_factory.mktemp("moe") / "qwen3-moe", **WIDE)


def loaded(path, method: str):
    return load_model(ModelConfig(path=str(path), method=method), LoraConfig())


def experts(model, layer: int = 0):
    """Layer `layer`'s experts as the model calls them (peft's outermost wrapper)."""
    return model.get_base_model().model.layers[layer].mlp.experts


def test_experts_are_stored_as_4_bit_codes_and_a_scale_per_64_weights(moe_path):
    model = loaded(moe_path, "qlora")
    stored = {name: p for name, p in model.named_parameters() if quant.is_packed_experts(name)}
    assert len(stored) == 4  # gate_up_proj and down_proj of 2 layers
    for name, packed in stored.items():
        weights = packed.expert_shape.numel()
        assert packed.numel() * packed.element_size() == weights // 2 + 4 * weights // 64, name
        assert not packed.requires_grad
    assert quant.packed_names(model) >= set(stored)
    base = AutoModelForCausalLM.from_pretrained(moe_path)
    trained, total = trainable_and_total(model)  # the start-up line counts weights, not packed bytes
    assert total - trained == sum(p.numel() for p in base.parameters())
    original = base.model.layers[0].mlp.experts.gate_up_proj
    read = experts(model).get_base_layer().gate_up_proj
    assert read.shape == original.shape
    error = (read - original).abs().max()
    assert 0 < error <= NF4_HALF_GAP * original.abs().max()


def test_lora_on_4_bit_experts_computes_lora_on_their_dequantized_weights(moe_path):
    """Both wrapped tensors get their term (the second one's used to be read from a cache without it), every
    forward alike (the factored term used to stay behind and add up), under plain LoRA's names."""
    qlora, lora = loaded(moe_path, "qlora"), loaded(moe_path, "lora")
    quant_experts.round_trip(lora)
    adapters = {n: p for n, p in qlora.named_parameters() if ".experts." in n and "lora_" in n}
    assert adapters.keys() == {n for n, p in lora.named_parameters() if ".experts." in n and "lora_" in n}
    torch.manual_seed(1)
    with torch.no_grad():
        for tensor in adapters.values():
            tensor.copy_(torch.randn_like(tensor) * 0.1)
        lora.load_state_dict(adapters, strict=False)
    hidden = torch.randn(6, 64)
    chosen, share = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]]), torch.full((6, 2), 0.5)
    expected = experts(lora)(hidden, chosen, share)
    got = experts(qlora)(hidden, chosen, share)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(experts(qlora)(hidden, chosen, share), got, rtol=0, atol=0)
    got.sum().backward()
    called = [p for name, p in adapters.items() if ".layers.0." in name]
    assert len(called) == 4 and all(p.grad is not None and p.grad.abs().max() > 0 for p in called)


@pytest.mark.usefixtures("signal_handlers_restored")
def test_qlora_trains_a_mixture_of_experts_and_merges_into_its_experts_as_trained(
    recipe, moe_path, tmp_path, capsys
):
    argv = [f"model.path={moe_path}", f"output_dir={tmp_path / 'run'}", "model.method=qlora"]
    argv += ["train.max_steps=2", "data.max_length=64", "eval.exact_match_samples=0", "eval.max_batches=1"]
    argv += ["train.save_every_steps=1", "train.log_every_steps=1"]
    assert run_main(recipe.main, [*argv, "export.merge=true"], "finetune_llm") == 0
    assert "experts stored in 4-bit" in capsys.readouterr().out
    final = tmp_path / "run" / "final"
    resumed = tmp_path / "resumed"  # its step-1 checkpoint, the 4-bit base's state inside, resumes exactly
    shutil.copytree(tmp_path / "run", resumed, ignore=shutil.ignore_patterns("final", "step-2"))
    assert run_main(recipe.main, [*argv, f"output_dir={resumed}"], "finetune_llm") == 0
    assert step_losses(resumed) == step_losses(tmp_path / "run")
    merged = AutoModelForCausalLM.from_pretrained(final / "merged").state_dict()
    trained = loaded(moe_path, "qlora")
    set_peft_model_state_dict(trained, load_file(final / "adapter_model.safetensors"))
    wrapper = experts(trained, 1)
    while hasattr(wrapper, "parameter_name"):
        delta = wrapper.get_delta_weight("default")
        assert delta.abs().max() > 0
        as_trained = getattr(wrapper.get_base_layer(), wrapper.parameter_name) + delta
        name = f"model.layers.1.mlp.experts.{wrapper.parameter_name}"
        torch.testing.assert_close(merged[name], as_trained, rtol=1e-5, atol=1e-6, msg=name)
        wrapper = wrapper.base_layer
