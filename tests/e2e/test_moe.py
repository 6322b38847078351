"""A tiny random mixture of experts (Qwen3-MoE shaped) trains LoRA with the routers' balancing loss on, on
2 gloo processes under DDP, FSDP2 and ZeRO-3, with the same per-step loss and balancing loss as one
process: the balancing loss is pooled over the data-parallel micro-batch, so the split does not change it.
QLoRA, its experts stored in 4-bit, does the same under FSDP2 and ZeRO-3."""

import pytest
from helpers import launch, run_recipe, step_losses, tiny_moe

from toolkit.train.metrics import read_metrics

pytestmark = pytest.mark.multiproc

STEPS = 4
# A coefficient large enough that the router's gradient moves the loss within a few steps.
SETTINGS = [f"train.max_steps={STEPS}", "train.learning_rate=2e-3", "moe.router_aux_loss_coef=0.1"]
BACKENDS = {"ddp": "backend ddp (gloo)", "fsdp": "backend fsdp2 (gloo)", "zero3": "backend deepspeed ZeRO-3"}


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return tiny_moe(tmp_path_factory.mktemp("moe") / "qwen3-moe")


@pytest.fixture(scope="module")
def single(moe_model, tmp_path_factory):
    """One process whose micro-batch is the union of the two processes' (8 rows, not 4 twice)."""
    out = tmp_path_factory.mktemp("moe-single") / "run"
    union = "train.micro_batch_size=8"
    run_recipe(out, f"model.path={moe_model}", *SETTINGS, union, launch=launch("single", 1))
    return out


def balancing(out) -> list[float]:
    return [
        line["router_aux_loss"] for line in read_metrics(out / "metrics.jsonl") if "router_aux_loss" in line
    ]


@pytest.mark.parametrize("config", BACKENDS)
def test_a_mixture_of_experts_trains_like_one_process(config, moe_model, single, tmp_path):
    out = tmp_path / "run"
    result = run_recipe(out, f"model.path={moe_model}", *SETTINGS, launch=launch(config))
    assert BACKENDS[config] in result.stdout and "experts: 4 a layer, 2 per token" in result.stdout
    assert len(step_losses(out)) == STEPS and len(balancing(out)) == STEPS
    assert step_losses(out) == pytest.approx(step_losses(single), rel=1e-3)
    # Tighter than the loss: balancing each rank alone is off by about 1e-3 on this model.
    assert balancing(out) == pytest.approx(balancing(single), rel=1e-4)
    assert (out / "final" / "adapter_model.safetensors").is_file()


# QLoRA: widths in multiples of 64 for bitsandbytes' CPU kernel; the fused experts stored in 4-bit.
WIDE = dict(num_key_value_heads=4, moe_intermediate_size=64, intermediate_size=64)
QLORA_BACKENDS = {"fsdp": BACKENDS["fsdp"], "zero3": BACKENDS["zero3"]}


@pytest.fixture(scope="module")
def qlora_settings(tmp_path_factory):
    path = tiny_moe(tmp_path_factory.mktemp("moe-wide") / "qwen3-moe", **WIDE)
    return [f"model.path={path}", "model.method=qlora", *SETTINGS]


@pytest.fixture(scope="module")
def qlora_single(qlora_settings, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-qlora-single") / "run"
    run_recipe(out, *qlora_settings, "train.micro_batch_size=8", launch=launch("single", 1))
    return out


@pytest.mark.parametrize("config", QLORA_BACKENDS)
def test_qlora_on_4_bit_experts_trains_like_one_process(config, qlora_settings, qlora_single, tmp_path):
    out = tmp_path / "run"
    result = run_recipe(out, *qlora_settings, launch=launch(config))
    assert QLORA_BACKENDS[config] in result.stdout
    assert "experts stored in 4-bit, 0.05 MiB" in result.stdout  # 55,296 bytes: 4.5 bits a weight
    assert len(step_losses(out)) == STEPS
    assert step_losses(out) == pytest.approx(step_losses(qlora_single), rel=1e-3)
    assert balancing(out) == pytest.approx(balancing(qlora_single), rel=1e-4)
