"""`ftkit plan` and the loss head: the chunked head's memory by hand, the full head's old figures, and the one
line that says what fits only thanks to the chunked head."""

import dataclasses

import pytest
from helpers import tiny_llama_config

from toolkit.commands import cli
from toolkit.config import LossConfig
from toolkit.launch.machine import GIB
from toolkit.plan.counts import count_parameters
from toolkit.plan.estimate import make_plan
from toolkit.plan.memory import FP32, Head, Precision, head_bytes
from toolkit.plan.report import render_text, to_json
from toolkit.plan.request import PlanRequest

CHUNK = LossConfig.chunk_tokens

BF16 = Precision(weights="bfloat16", mixed="bf16")
LLAMA3 = "meta-llama/Meta-Llama-3-8B"


# The launch line names recipes/configs/ files, looked up where the line is run: a checkout's root.
pytestmark = pytest.mark.usefixtures("at_the_checkout_root")


def _counts(method: str, vocab: int = 1000, hidden: int = 10):
    """The small model's counts with a round vocabulary and width, so the arithmetic reads plainly."""
    counts = count_parameters(tiny_llama_config(), "full", 4)
    return dataclasses.replace(counts, method=method, vocab=vocab, hidden=hidden)


@pytest.mark.parametrize(
    "method, backend, precision, head, expected",
    [
        # 300 tokens, vocab 1000, hidden 10; full: e + 8 = 10 bytes a logit.
        ("lora", "single", BF16, Head("full", 100), 300 * 1000 * 10),
        # chunked: 100 x 1000 fp32 chunk + its bf16 gradient, and the hidden states' bf16 gradient kept.
        ("lora", "single", BF16, Head("chunked", 100), 100 * 1000 * (4 + 2) + 300 * 10 * 2),
        # a chunk larger than the micro-batch holds only its tokens
        ("lora", "single", BF16, Head("chunked", 1024), 300 * 1000 * (4 + 2) + 300 * 10 * 2),
        # full fine-tune: the head weight's gradient is kept from forward too (bf16 weights: 2 bytes)
        ("full", "single", BF16, Head("chunked", 100), 100 * 1000 * 6 + 300 * 10 * 2 + 1000 * 10 * 2),
        # fp32 throughout: no cast copy of the chunk's gradient, 4-byte everything else
        ("full", "single", FP32, Head("chunked", 100), 100 * 1000 * 4 + 300 * 10 * 4 + 1000 * 10 * 4),
        # fp32 weights under bf16 autocast: FSDP gathers the head in bf16, single keeps its fp32 weight
        (
            "full",
            "fsdp",
            Precision(mixed="bf16"),
            Head("chunked", 100),
            100 * 1000 * 6 + 6000 + 1000 * 10 * 2,
        ),
        (
            "full",
            "single",
            Precision(mixed="bf16"),
            Head("chunked", 100),
            100 * 1000 * 6 + 6000 + 1000 * 10 * 4,
        ),
        # preference log-probs: the chunk only, recomputed in backward; nothing kept, LoRA or full
        ("lora", "single", BF16, Head("chunked", 100, log_probs=True), 100 * 1000 * (4 + 2)),
        ("full", "single", FP32, Head("chunked", 100, log_probs=True), 100 * 1000 * (4 + 4)),
    ],
)
def test_head_bytes_by_hand(method, backend, precision, head, expected):
    assert head_bytes(_counts(method), 300, backend, precision, head) == expected


def _totals(plan, backends=("ddp", "zero3_offload")):
    return {(r.backend, r.checkpointing): r.per_gpu()["total"] for r in plan.rows if r.backend in backends}


@pytest.mark.parametrize(
    "request_args, before",
    [
        # Per-GPU totals the plan printed before the chunked head (commit db86efa), micro-batch 1, 2x24 GiB.
        (dict(method="lora", seq_len=2048), {"ddp": 23_715_364_044, "zero3_offload": 7_317_244_313}),
        (
            dict(method="lora", seq_len=1024, objective="dpo"),
            {"ddp": 23_715_364_044, "zero3_offload": 7_317_244_313},
        ),
        (dict(method="full", seq_len=2048), {"ddp": 198_892_596_428, "zero3_offload": 7_899_728_281}),
    ],
)
def test_loss_head_full_reproduces_the_old_figures(request_args, before):
    request = PlanRequest(model=LLAMA3, gpus=2, gpu_mem=24, micro_batch=1, grad_ckpt="on", **request_args)
    full = make_plan(dataclasses.replace(request, loss_head="full"))
    assert _totals(full) == {(backend, True): total for backend, total in before.items()}


def test_lora_shrinks_while_a_full_fine_tune_keeps_the_head_weights_gradient():
    """A full fine-tune's head keeps DDP's fp32 head-weight gradient from forward beside one chunk."""
    request = PlanRequest(model=LLAMA3, gpus=2, gpu_mem=24, micro_batch=1, grad_ckpt="on")
    lora = make_plan(request)
    assert _totals(lora)[("ddp", True)] < 23_715_364_044
    full = make_plan(dataclasses.replace(request, method="full"))
    ddp = next(r for r in full.rows if r.backend == "ddp")
    assert ddp.head == CHUNK * 128_256 * 6 + 2048 * 4096 * 2 + 128_256 * 4096 * 4


@pytest.fixture(scope="module")
def long_lora():
    """Llama-3-8B LoRA at 8,192 tokens on one 24 GiB card, under each head."""
    request = PlanRequest(model=LLAMA3, gpus=1, gpu_mem=24, method="lora", seq_len=8192)
    return make_plan(request), make_plan(dataclasses.replace(request, loss_head="full"))


def test_llama3_8b_lora_at_8k_fits_one_24gb_card_thanks_to_the_chunked_head(long_lora):
    chunked, full = long_lora
    assert (chunked.choice.backend, chunked.choice.checkpointing) == ("single", True)
    assert full.choice.backend == "zero3_offload"  # the full logits leave only offload
    # 8192 x 128,256 logits at 10 bytes, against one default chunk at 6 and the bf16 hidden gradient.
    logits, chunk = 8192 * 128_256 * 10, CHUNK * 128_256 * 6 + 8192 * 4096 * 2
    assert (chunked.full_head.head, chunked.choice.head) == (logits, chunk)
    more = (chunked.full_head.per_gpu()["total"] - chunked.choice.per_gpu()["total"]) / GIB
    assert more == pytest.approx((logits - chunk) * 1.1 / GIB, abs=1e-6)  # + 10% fragmentation
    line = f"fits thanks to the chunked loss head: the full logits would need {more:.1f} GiB more per GPU at "
    line += "micro-batch 1 (32.7 of 24 GiB)"
    assert line in render_text(chunked) and f"{more:.1f}" == "10.3"
    assert "fits thanks to" not in render_text(full)
    assert (
        to_json(chunked)["recommendation"]["full_head_per_gpu_bytes"] == chunked.full_head.per_gpu()["total"]
    )


def test_no_line_when_the_full_logits_fit_too():
    plan = make_plan(
        PlanRequest(model=LLAMA3, gpus=2, gpu_mem=24, method="lora", seq_len=1024, micro_batch=1)
    )
    assert plan.full_head is not None and plan.fits(plan.full_head)
    assert "fits thanks to" not in render_text(plan)


def test_the_flags_reach_the_plan_and_its_launch_line(capsys):
    argv = ["plan", "--model", LLAMA3, "--gpus", "2", "--seq-len", "1024", "--grad-ckpt", "on"]
    assert cli.main([*argv, "--loss-head", "full"]) == 0
    out = capsys.readouterr().out
    assert "| full logits" in out and " loss.head=full " in out
    assert cli.main([*argv, "--chunk-tokens", "256"]) == 0
    out = capsys.readouterr().out
    assert "chunked loss head (256 tokens)" in out and " loss.chunk_tokens=256 " in out
    assert "loss.head=" not in out  # the shipped config's default already


def test_auto_backend_plans_the_recipe_configs_loss_head():
    from toolkit.commands.auto_backend import plan_request
    from toolkit.recipes import load_recipe_config as recipe_config

    config = "recipes/configs/llama3-8b-lora.yaml"
    default = plan_request(recipe_config("sft", config, []), [], 2, 24.0)
    assert (default.loss_head, default.chunk_tokens) == ("auto", CHUNK)
    cfg = recipe_config("sft", config, ["loss.head=full", "loss.chunk_tokens=256"])
    assert (plan_request(cfg, [], 2, 24.0).loss_head, plan_request(cfg, [], 2, 24.0).chunk_tokens) == (
        "full",
        256,
    )


def test_auto_plans_the_full_logits_for_a_model_the_chunked_head_cannot_follow(tmp_path):
    """Cohere scales its logits after the head (logit_scale): loss.head auto trains it with the full
    logits, and the plan counts them."""
    from transformers import CohereConfig

    CohereConfig(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)  # fmt: skip
    args = dict(model=str(tmp_path), gpus=1, gpu_mem=24, method="lora", seq_len=1024, micro_batch=1)
    auto, full = make_plan(PlanRequest(**args)), make_plan(PlanRequest(**args, loss_head="full"))
    assert auto.choice.head == full.choice.head and auto.full_head is None
    assert "| full logits" in render_text(auto)
    chunked = make_plan(PlanRequest(**args, loss_head="chunked"))
    assert chunked.choice.head < full.choice.head
