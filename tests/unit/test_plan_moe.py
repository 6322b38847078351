"""`ftkit plan` on mixtures of experts: the three models of the built-in table answer on 2 x 24 GiB with a
launch line, active parameters and FLOPs count only the experts a token is sent to (checked against torch's
FLOP counter on a tiny model), QLoRA counts its experts in 4-bit, and expert parallelism splits the experts
alone."""

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

from toolkit.model import moe
from toolkit.model.flops import ModelShape, flops_per_token
from toolkit.model.tensor_parallel import split_styles
from toolkit.plan.counts import count_parameters, load_model_config
from toolkit.plan.estimate import make_plan
from toolkit.plan.report import render_text
from toolkit.plan.request import PlanRequest

MOE_MODELS = ("Qwen/Qwen3-30B-A3B", "openai/gpt-oss-20b", "mistralai/Mixtral-8x7B-v0.1")
SEQ = 6
# One layer, 4 experts of width 8, 2 per token, hidden 16 (4 heads of 4), vocab 32: every matmul is small.
TINY_MOE = dict(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=24,
    moe_intermediate_size=8,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=16,
)


@pytest.mark.parametrize("model_id", MOE_MODELS)
def test_each_real_mixture_of_experts_gets_an_answer_on_two_24_gib_gpus(model_id):
    plan = make_plan(PlanRequest(model=model_id, gpus=2, gpu_mem=24.0, method="qlora"))
    text = render_text(plan)
    assert plan.choice is not None and "accelerate launch --config_file" in text
    assert "routed experts a layer" in text and "expert parameters in 4-bit (4.5 bits a weight" in text


def fitting_row(plan, backend: str):
    return next(row for row in plan.rows if row.backend == backend and row.checkpointing)


def test_qwen3_30b_a3b_qlora_fits_two_24_gib_gpus_without_offload_only_with_no_margin():
    request = PlanRequest(model="Qwen/Qwen3-30B-A3B", gpus=2, gpu_mem=24.0, method="qlora")
    kept = make_plan(request)  # 5% of each card kept free: only with offload
    assert kept.choice.backend == "zero3_offload"
    assert "fits only without the 5% margin (--margin 0; " in render_text(kept)
    assert "memory): fsdp 23.0 GiB, zero3 23.0 GiB" in render_text(kept)
    plan = make_plan(dataclasses.replace(request, margin=0.0))
    # FSDP2 and ZeRO-3 both fit (the same 23.0 GiB at micro-batch 1); FSDP2 is the faster tier.
    assert plan.choice.backend == "fsdp" and not plan.choice.states.in_cpu_ram
    assert plan.fits(fitting_row(plan, "zero3"))
    experts = plan.counts.expert_params
    assert experts == 28_991_029_248
    # Each GPU's frozen share: half of everything, the experts at 0.5625 bytes a weight (in 16-bit, 2:
    # 27 GiB of experts alone); the rest (4-bit attention, fp32 embeddings and norms) about 0.8 GiB.
    experts_share = experts / 2 * 0.5625
    assert experts_share < plan.choice.states.frozen < experts_share + 1.0 * 2**30


def test_active_parameters_are_what_the_model_cards_give():
    """Mixtral-8x7B: 12.9B active; gpt-oss-20b: 3.6B active without its input embeddings; Qwen3-30B-A3B:
    3.3B."""
    active = {}
    for model_id in MOE_MODELS:
        counts = count_parameters(load_model_config(model_id)[0], "full", 16)
        input_embeddings = counts.embed if model_id == "openai/gpt-oss-20b" else 0
        active[model_id] = counts.active - input_embeddings
    assert active == pytest.approx(
        {MOE_MODELS[0]: 3.35e9, MOE_MODELS[1]: 3.61e9, MOE_MODELS[2]: 12.88e9}, rel=0.01
    )


def test_routing_of_dense_and_mixture_models():
    assert moe.routing(AutoConfig.for_model("llama")) == moe.Routing()
    qwen2 = moe.routing(AutoConfig.for_model("qwen2_moe"))
    assert (qwen2.experts, qwen2.per_token, qwen2.expert_width, qwen2.shared_width) == (60, 4, 1408, 5632)
    assert qwen2.active_width == 4 * 1408 + 5632 and qwen2.active_share == 4 / 60


@pytest.mark.parametrize("kernel", ["eager", "batched_mm"])
def test_flops_count_only_the_experts_a_token_is_sent_to_as_torch_counts_them(kernel):
    """Torch's counter has no rule for the grouped_mm kernel (transformers' default): the loop over experts
    and the batched kernel show what every kernel computes."""
    config = AutoConfig.for_model(
        "qwen3_moe", **TINY_MOE, attn_implementation="eager", experts_implementation=kernel
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    batch = torch.randint(0, 32, (3, SEQ))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=batch).logits.sum().backward()
    measured = counter.get_total_flops() / batch.numel()
    counted = ModelShape.of(model).flops_per_token(SEQ)
    assert counted == flops_per_token(count_parameters(config, "full", 2), SEQ)
    # Attention: q, k, v, o (16 x 16 each); the router (16 x 4); 2 of 4 experts (gate+up 16 x 16, down 8 x
    # 16); the head (16 x 32); 6 FLOPs a weight, and 12 x seq x 16 for the scores.
    assert counted == 6 * (4 * 256 + 64 + 2 * (256 + 128) + 512) + 12 * SEQ * 16
    assert measured == counted


def test_tensor_parallel_counts_skip_the_expert_styles_it_does_not_apply():
    config = AutoConfig.for_model("qwen3_moe", **TINY_MOE)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    styles = split_styles(model, config.base_model_tp_plan)
    assert set(styles.values()) == {"colwise", "rowwise"} and not any("experts" in name for name in styles)


@pytest.mark.parametrize(
    "name, backend, first, margin",
    [
        ("qwen3-30b-a3b-qlora", "zero3", "fsdp", 0.0),
        ("gpt-oss-20b-lora", "zero3_offload", "zero3_offload", 0.05),
    ],
)
def test_the_shipped_moe_configs_fit_as_their_headers_say(name, backend, first, margin):
    from helpers import REPO

    from toolkit.recipes import load_any_recipe_config

    cfg = load_any_recipe_config(REPO / "recipes" / "configs" / f"{name}.yaml")
    request = PlanRequest(
        model=cfg.model.path, gpus=2, gpu_mem=24.0, method=cfg.model.method, grad_ckpt="on", margin=margin
    )
    plan = make_plan(request)
    assert plan.choice.backend == first and plan.choice.checkpointing
    assert f"accelerate_configs/{first}.yaml --num_processes 2" in render_text(plan)
    assert plan.fits(fitting_row(plan, backend))  # the backend the config was proven on, if not the first
    header = (REPO / "recipes" / "configs" / f"{name}.yaml").read_text()
    assert f"accelerate launch --config_file accelerate_configs/{backend}.yaml" in header
    assert ("--margin 0" in header) == (margin == 0)


def test_expert_parallelism_splits_the_experts_alone_and_needs_full_weights():
    """ep 8 on Mixtral-8x7B: each GPU keeps 1/8 of the experts and the rest whole, with bf16 autocast copies
    of what it holds; QLoRA is refused in one line; a dense model gets no ep layout."""
    import math

    plan = make_plan(PlanRequest(model=MOE_MODELS[2], gpus=8, gpu_mem=80.0, method="full"))
    ep = next(layout for layout in plan.layouts if layout.mesh.ep == 8)
    c, row = plan.counts, ep.rows[0]
    held = c.total - c.expert_params + math.ceil(c.expert_params / 8)
    assert row.states.trainable == 4 * held
    assert row.working == pytest.approx(2 * (held - c.embed), rel=1e-4)  # every weight but norms, embeddings
    assert row.per_gpu()["total"] < next(r for r in plan.rows if r.backend == "ddp").per_gpu()["total"] / 4
    assert "ep E: the routed experts split E ways" in render_text(plan)
    qlora = make_plan(PlanRequest(model=MOE_MODELS[2], gpus=8, gpu_mem=80.0, method="qlora"))
    refusal = next(layout for layout in qlora.layouts if layout.mesh.ep == 8).refusal
    assert refusal.startswith("qlora adapts the experts")
    dense = make_plan(PlanRequest(model="meta-llama/Llama-3.1-8B", gpus=8, gpu_mem=80.0, method="full"))
    assert not any(layout.mesh.ep > 1 for layout in dense.layouts)
