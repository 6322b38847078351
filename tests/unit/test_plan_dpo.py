"""`ftkit plan --objective dpo`: two sequences per pair, a separate reference model's weights when asked,
and a launch line for the preference recipe and its shipped config."""

import pytest

from toolkit.errors import UserError
from toolkit.plan.estimate import make_plan
from toolkit.plan.request import PlanRequest

LLAMA = dict(model="meta-llama/Meta-Llama-3-8B", gpus=2, gpu_mem=24, method="lora", seq_len=1024)


def row(plan, backend, ckpt=True):
    return next(r for r in plan.rows if r.backend == backend and r.checkpointing == ckpt)


def test_pairs_double_the_activations_and_the_reference_adds_its_weights():
    sft = make_plan(PlanRequest(**LLAMA, micro_batch=1))
    dpo = make_plan(PlanRequest(**LLAMA, micro_batch=1, objective="dpo"))
    with_reference = make_plan(PlanRequest(**LLAMA, micro_batch=1, objective="dpo", reference_model=True))
    layers = [row(plan, "ddp").activations - row(plan, "ddp").head for plan in (sft, dpo)]
    assert layers[1] == 2 * layers[0]
    assert row(dpo, "ddp").per_gpu()["weights"] == row(sft, "ddp").per_gpu()["weights"]
    whole = sft.counts.total * 2  # bfloat16 weights
    assert row(with_reference, "ddp").per_gpu()["reference"] == whole
    assert row(with_reference, "fsdp").per_gpu()["reference"] == whole // 2  # sharded like the policy
    assert "reference" not in row(dpo, "ddp").per_gpu()


def test_the_chunked_head_keeps_one_chunk_of_log_probs_for_a_pair():
    """2 x 1024 tokens, chunks of 512: one 512 x 128,256 chunk in fp32 plus its bf16 gradient, nothing kept
    from forward; the full logits double with the pair like every other activation."""
    dpo = make_plan(PlanRequest(**LLAMA, micro_batch=1, objective="dpo", chunk_tokens=512))
    assert row(dpo, "ddp").head == 512 * 128_256 * (4 + 2)
    sft = make_plan(PlanRequest(**LLAMA, micro_batch=1, loss_head="full"))
    full = make_plan(PlanRequest(**LLAMA, micro_batch=1, objective="dpo", loss_head="full"))
    assert row(full, "ddp").head == 2 * 1024 * 128_256 * (2 + 8)
    assert row(full, "ddp").activations == 2 * row(sft, "ddp").activations


def test_llama3_dpo_lora_on_two_4090s_and_its_launch_line():
    plan = make_plan(PlanRequest(**LLAMA, global_batch=32, objective="dpo"))
    assert plan.choice is not None and plan.choice.backend in ("ddp", "zero1", "zero2")
    assert "recipes/dpo_llm.py --config recipes/configs/llama3-8b-dpo-lora.yaml" in plan.command


def test_reference_model_needs_dpo():
    with pytest.raises(UserError, match="--reference-model is for --objective dpo"):
        make_plan(PlanRequest(**LLAMA, reference_model=True))
