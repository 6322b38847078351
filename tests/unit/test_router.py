"""The routers' load-balancing loss: transformers' value on one process, and the same value and gradient
when the micro-batch is split across data-parallel ranks (their counts and probabilities pooled)."""

import warnings

import pytest
import torch
from helpers import tiny_moe_config
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from toolkit.config import MoeConfig
from toolkit.model import moe
from toolkit.train.router import DEFAULT_COEF, RouterBalance, router_coef


def random_moe():
    torch.manual_seed(0)
    config = tiny_moe_config(router_aux_loss_coef=0.02)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def batch(rows: int = 4, length: int = 7):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2048, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0  # padding: the router's choice there is no load
    mask[3, 2:] = 0
    return ids, mask


def router_loss(model, ids, mask, sum_over_data, data_parallel):
    """(the loss term for backward, the balance) of one rank's rows."""
    balance = RouterBalance(model, moe.routing(model.config), 1.0, sum_over_data, data_parallel)
    with balance.micro_batch():
        model(input_ids=ids, attention_mask=mask)
        return balance.loss(mask), balance


def test_one_process_gives_transformers_value_and_the_step_metrics():
    model, (ids, mask) = random_moe(), batch()
    logits = []
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(lambda m, a, out: logits.append(out[0]))
    term, balance = router_loss(model, ids, mask, lambda x: x, 1)
    expected = load_balancing_loss_func(tuple(logits), 4, 2, mask)
    metrics = balance.step_metrics()
    assert term.item() == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["router_aux_loss"] == pytest.approx(expected.item(), rel=1e-6)
    assert 1.0 <= metrics["expert_load_max"] <= 2.0 and balance.step_metrics() == {}


def test_two_ranks_pool_into_the_one_process_value_and_gradient():
    ids, mask = batch()
    whole = random_moe()
    term, balance = router_loss(whole, ids, mask, lambda x: x, 1)
    term.backward()
    value = balance.step_metrics()["router_aux_loss"]
    expected = {n: p.grad.clone() for n, p in whole.named_parameters() if p.grad is not None}

    halves = [(ids[:2], mask[:2]), (ids[2:], mask[2:])]
    local = []  # each rank's counts and probability sums, as the all-reduce would add them
    for part in halves:
        router_loss(random_moe(), *part, lambda x: local.append(x.clone()) or x, 2)
    grads, values = {}, []
    for rank, part in enumerate(halves):
        model = random_moe()
        term, balance = router_loss(model, *part, lambda x, other=local[1 - rank]: x + other, 2)
        term.backward()
        values.append(balance.step_metrics()["router_aux_loss"])
        for name, param in model.named_parameters():
            if param.grad is not None:  # the backend averages the two ranks' gradients
                grads[name] = grads.get(name, 0) + param.grad / 2
    assert values == pytest.approx([value, value], rel=1e-6)
    assert grads.keys() == expected.keys() and any("gate" in name for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7)


def test_the_coefficient_comes_from_the_config_the_model_or_the_default():
    config = tiny_moe_config(router_aux_loss_coef=0.02)
    assert router_coef(MoeConfig(), config) == 0.02
    assert router_coef(MoeConfig(router_aux_loss_coef=0.0), config) == 0.0
    assert router_coef(MoeConfig(), AutoConfig.for_model("llama")) == DEFAULT_COEF


def test_a_dense_model_adds_nothing():
    config = AutoConfig.for_model(
        "llama",
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=32,
    )
    model = AutoModelForCausalLM.from_config(config)
    balance = RouterBalance(model, moe.routing(config), 1.0, lambda x: x, 1)
    with balance.micro_batch():
        model(input_ids=torch.zeros(1, 3, dtype=torch.long))
        assert balance.loss(torch.ones(1, 3)) == 0.0
    assert balance.step_metrics() == {}


COMMON = ["model.adapter=null", "train.max_steps=2", "train.log_every_steps=1", "train.global_batch_size=8"]
COMMON += [
    "train.micro_batch_size=4",
    "data.max_length=48",
    "eval.max_batches=0",
    "eval.exact_match_samples=0",
]
RECIPE_ARGS = {
    "dpo_llm": ["data.eval=null", "data.eval_fraction=0.1"],
    "grpo_llm": [
        "data.eval=null",
        "data.eval_fraction=0.02",
        "grpo.num_generations=4",
        "grpo.max_new_tokens=4",
        "grpo.rewards=[length]",
    ],
}


@pytest.mark.usefixtures("signal_handlers_restored")
@pytest.mark.parametrize("name", RECIPE_ARGS)
def test_preference_tuning_and_grpo_balance_the_router_too(name, tmp_path, capsys):
    from helpers import load_recipe, tiny_moe

    from toolkit.errors import run_main
    from toolkit.train.metrics import read_metrics

    model = tiny_moe(tmp_path / "moe")
    argv = [f"model.path={model}", f"output_dir={tmp_path / 'run'}", *COMMON, *RECIPE_ARGS[name]]
    assert run_main(load_recipe(name).main, argv, name) == 0, capsys.readouterr().err[-2000:]
    logged = [line for line in read_metrics(tmp_path / "run" / "metrics.jsonl") if "router_aux_loss" in line]
    assert [line["step"] for line in logged] == [1, 2] and all(line["router_aux_loss"] > 1 for line in logged)


def test_lora_on_fused_experts_gives_gate_up_twice_the_rank_and_the_run_says_nothing(recwarn):
    """peft warns that its gate_up_proj rank pattern matched no module: the run silences that (console),
    since the adapter does get the doubled rank."""
    from toolkit import console
    from toolkit.config import LoraConfig
    from toolkit.model.load import _with_adapter

    with warnings.catch_warnings():
        console.quiet_third_party()
        model = _with_adapter(random_moe(), LoraConfig(r=4, target_modules="all-linear"))
    shapes = {
        n.split("layers.0.mlp.")[1]: tuple(p.shape) for n, p in model.named_parameters() if "0.mlp.exp" in n
    }
    # (rank x experts, in): gate_up_proj (hidden 64 -> 2 x 32) at rank 8, down_proj (32 -> 64) at rank 4.
    assert shapes["experts.base_layer.lora_A.default.weight"] == (8 * 4, 64)
    assert shapes["experts.lora_A.default.weight"] == (4 * 4, 32)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_the_trained_parts_of_a_mixture_of_experts_are_counted_apart():
    from toolkit.config import LoraConfig
    from toolkit.model.load import _with_adapter

    model = _with_adapter(random_moe(), LoraConfig(r=4, target_modules="all-linear", router=True))
    parts = moe.trained_parts(model)
    assert set(parts) == {"attention", "experts", "router"}
    # A layer: gate_up_proj's adapter (rank 8 x 4 experts, 64 -> 64) and down_proj's (rank 4 x 4, 32 -> 64);
    # the router's (rank 4, 64 -> 4).
    assert parts["experts"] == 2 * (32 * 64 + 64 * 32 + 16 * 32 + 64 * 16)
    assert parts["router"] == 2 * (4 * 64 + 4 * 4)
    assert sum(parts.values()) == sum(p.numel() for p in model.parameters() if p.requires_grad)
