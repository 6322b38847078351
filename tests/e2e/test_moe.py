"""Tiny random mixtures of experts train with the routers' balancing loss on, on 2 gloo processes, with
the same per-step loss and balancing loss as one process: the balancing loss is pooled over the
data-parallel micro-batch, so the split does not change it. Qwen3-MoE under DDP (full fine-tuning),
Mixtral under FSDP2, gpt-oss (eager attention, experts with biases) under ZeRO-3; DPO on Qwen3-MoE under
expert parallelism (Qwen2-MoE with its shared expert; LoRA on attention, the shared expert and the router);
QLoRA on Qwen3-MoE, its experts stored in 4-bit, under ZeRO-3; expert parallelism with full fine-tuning,
resumed.

Launches: started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher), except expert
parallelism's run and its resumes, which launch for real (ep.yaml's real launch).
"""

import pytest
from helpers import REPO, launch, run_recipe, step_losses, tiny_moe

from toolkit.train.metrics import read_metrics

pytestmark = pytest.mark.multiproc

STEPS = 4
# A coefficient large enough that the router's gradient moves the loss within a few steps.
SETTINGS = [f"train.max_steps={STEPS}", "train.learning_rate=2e-3", "moe.router_aux_loss_coef=0.1"]
UNION = "train.micro_batch_size=8"  # one process's micro-batch: the two processes' 4 rows each together
BACKENDS = {"ddp": "backend ddp (gloo)", "fsdp": "backend fsdp2 (gloo)", "zero3": "backend deepspeed ZeRO-3"}
BACKENDS["ep"] = f"{BACKENDS['ddp']}"  # a plain multi-process launch; the recipe config splits the experts
# QLoRA: widths in multiples of 64 for bitsandbytes' CPU kernel.
WIDE = dict(num_key_value_heads=4, moe_intermediate_size=64, intermediate_size=64)
DPO = dict(recipe=REPO / "recipes" / "dpo_llm.py", config=str(REPO / "recipes" / "configs" / "demo-dpo.yaml"))
FULL = ["model.method=full", "train.learning_rate=2e-4", "train.save_every_steps=2"]
DPO_SETTINGS = ["model.adapter=null", "model.method=lora", "eval.max_batches=0"]
# (what, model type, tiny model's overrides, recipe settings, run_recipe's keywords)
VARIANTS = {
    "mixtral": ("mixtral", {}, [], {}),
    "gpt_oss": ("gpt_oss", {}, [], {}),
    "dpo": ("qwen2_moe", {}, [*DPO_SETTINGS, "lora.experts=false", "lora.router=true"], DPO),
    "qlora": ("qwen3_moe", WIDE, ["model.method=qlora"], {}),
    "full": ("qwen3_moe", {}, FULL, {}),
}
# Qwen3-MoE runs full fine-tuning under DDP (its one process is also expert parallelism's) and QLoRA under
# ZeRO-3; Mixtral and gpt-oss take FSDP2's and ZeRO-3's LoRA; DPO runs on expert parallelism (which is DDP
# for all but the experts).
CASES = [("full", "ddp"), ("mixtral", "fsdp"), ("gpt_oss", "zero3"), ("dpo", "ep"), ("qlora", "zero3")]
SPLIT = "moe.expert_parallel=2"


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """variant -> (its launch settings, the output_dir of one process on the union micro-batch), trained
    once when first asked for."""
    done = {}

    def get(variant: str):
        if variant not in done:
            model_type, shape, settings, keywords = VARIANTS[variant]
            model = tiny_moe(tmp_path_factory.mktemp(variant) / model_type, model_type, **shape)
            settings = [f"model.path={model}", *SETTINGS, *settings]
            out = tmp_path_factory.mktemp(f"{variant}-single") / "run"
            run_recipe(out, *settings, UNION, launch=launch("single", 1), **keywords)
            done[variant] = settings, out
        return done[variant]

    return get


def balancing(out) -> list[float]:
    return [
        line["router_aux_loss"] for line in read_metrics(out / "metrics.jsonl") if "router_aux_loss" in line
    ]


@pytest.mark.parametrize("variant, config", CASES, ids=[f"{v}-{c}" for v, c in CASES])
def test_a_mixture_of_experts_trains_like_one_process(variant, config, single, tmp_path):
    settings, reference = single(variant)
    out = tmp_path / "run"
    split = [SPLIT] if config == "ep" else []
    result = run_recipe(out, *settings, *split, launch=launch(config), **VARIANTS[variant][3])
    assert BACKENDS[config] in result.stdout and "experts: 4 a layer, 2 per token" in result.stdout
    if variant == "dpo":  # the parts LoRA trains, counted (test_moe_lora.py checks them on every family)
        trained = "trained: attention 14,336, router 2,176, shared expert 14,368; experts split over 2"
        assert trained in result.stdout
    assert len(step_losses(out)) == STEPS and len(balancing(out)) == STEPS
    assert step_losses(out) == pytest.approx(step_losses(reference), rel=1e-3)
    # Tighter than the loss: balancing each rank alone is off by about 1e-3 on this model.
    assert balancing(out) == pytest.approx(balancing(reference), rel=1e-4)
    exported = "model.safetensors" if variant == "full" else "adapter_model.safetensors"
    assert (out / "final" / exported).is_file()
    if variant == "qlora":
        assert "experts stored in 4-bit, 0.05 MiB" in result.stdout  # 55,296 bytes: 4.5 bits a weight


@pytest.mark.real_launch
def test_expert_parallelism_trains_resumes_and_exports_like_one_process(single, tmp_path):
    """Experts split over 2 processes (full fine-tuning): the steps of one process on the union
    micro-batch, exported as plain HF files with the same weights; its step-2 checkpoint resumes exactly,
    and through the portable path under DDP (weights and optimizer moments: the same losses)."""
    import shutil

    from transformers import AutoModelForCausalLM

    settings, reference = single("full")
    out = tmp_path / "ep"
    result = run_recipe(out, *settings, SPLIT, launch=launch("ep"))
    assert "experts split over 2 processes" in result.stdout
    assert step_losses(out) == pytest.approx(step_losses(reference), rel=1e-5)
    assert balancing(out) == pytest.approx(balancing(reference), rel=1e-5)
    got = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    expected = AutoModelForCausalLM.from_pretrained(reference / "final").state_dict()
    assert got.keys() == expected.keys()
    assert max((got[k] - expected[k]).abs().max() for k in got) < 1e-5
    for config, extra in (("ep", [SPLIT]), ("ddp", [])):
        resumed = tmp_path / f"resumed-{config}"
        shutil.copytree(out, resumed, ignore=shutil.ignore_patterns("final", "step-4"))
        result = run_recipe(resumed, *settings, *extra, launch=launch(config))
        assert "at step 2" in result.stdout
        assert step_losses(resumed) == pytest.approx(step_losses(out), rel=1e-5), config
    assert (
        "resumed weights, optimizer and learning-rate schedule from a MULTI_CPU world 2 ep 2" in result.stdout
    )
