"""`ftkit plan` beside the data-parallel backends: tensor parallelism (tp), FSDP2 x TP (fsdp_tp) and hybrid
sharding (hsdp), their memory and traffic by hand, the meshes each GPU count gets, and the refusals.

The small model (tests/helpers.py): vocab 128, hidden 32, MLP 64, 2 layers, 4 heads (2 kv) of 8.
    embeddings 128 x 32 = 4,096, lm_head 4,096 (untied), final norm 32
    each layer: q 1,024, k 512, v 512, o 1,024, gate 2,048, up 2,048, down 2,048 = 9,216 split by TP,
                plus 2 norms of 32
    total 26,784 = 18,432 split + 8,352 replicated (embeddings, head, the 5 norms)
"""

import dataclasses

import pytest
from helpers import tiny_llama_config
from transformers import GPT2Config

from toolkit.commands import cli
from toolkit.plan import memory
from toolkit.plan.counts import count_parameters
from toolkit.plan.estimate import make_plan
from toolkit.plan.parallel import Mesh, meshes, refusal
from toolkit.plan.report import render_text, to_json
from toolkit.plan.request import PlanRequest

LLAMA3 = "meta-llama/Meta-Llama-3-8B"


# The launch line names recipes/configs/ files, looked up where the line is run: a checkout's root.
pytestmark = pytest.mark.usefixtures("at_the_checkout_root")


def _fp32_plan(model: str, gpus: int, method: str = "full", **options):
    """fp32 weights, no autocast, micro-batch 1, seq 64, 8 examples a step: 4 bytes for everything."""
    return make_plan(
        PlanRequest(
            model=model,
            gpus=gpus,
            method=method,
            dtype="float32",
            mixed_precision="no",
            seq_len=64,
            global_batch=8,
            micro_batch=1,
            grad_ckpt="off",
            **options,
        )
    )


def _row(plan, backend: str):
    """The first row of `backend` (grad ckpt off) and the bytes it sends per step."""
    if backend in {layout.mesh.backend for layout in plan.layouts}:
        layout = next(layout for layout in plan.layouts if layout.mesh.backend == backend)
        return layout.rows[0], layout.comm[0]
    return next(row for row in plan.rows if row.backend == backend), plan.comm.get(backend)


def test_split_counts_are_the_attention_and_mlp_linears():
    full = count_parameters(tiny_llama_config(), "full", 4)
    assert (full.tp_styles, full.tp_split_frozen, full.tp_split_trainable) == (
        ("colwise", "rowwise"),
        0,
        18_432,
    )
    # LoRA r=4 puts an adapter on every split linear; one piece of each splits with it (B of q/k/v/gate/up:
    # 4 x (32 + 16 + 16 + 64 + 64), A of o/down: 4 x (32 + 64)), 1,152 a layer; the other piece stays whole.
    lora = count_parameters(tiny_llama_config(), "lora", 4)
    assert (lora.tp_split_frozen, lora.tp_split_trainable, lora.trainable) == (18_432, 2_304, 4_096)


def test_tp_halves_the_split_linears_but_not_the_embeddings_or_head(tiny):
    plan = _fp32_plan(tiny(), gpus=4)
    states = {backend: _row(plan, backend)[0].states for backend in ("ddp", "fsdp", "fsdp_tp", "hsdp")}
    assert states["ddp"].trainable == 26_784 * 4 == 107_136
    # tp on 4 GPUs is refused (2 kv heads); fsdp_tp 2x2 splits TP 2 ways, then FSDP 2 ways:
    # per TP rank 8,352 replicated + 18,432 / 2 split = 17,568 parameters, then 8,784 per FSDP shard.
    assert states["fsdp_tp"].trainable == 8_784 * 4 == 35_136
    assert states["fsdp_tp"].grads == 35_136 and states["fsdp_tp"].optimizer == 2 * 35_136
    # hsdp 2x2 shards 2 ways, not 4: 13,392 parameters, twice fsdp's 6,696 on 4 GPUs.
    assert (states["hsdp"].trainable, states["fsdp"].trainable) == (13_392 * 4, 6_696 * 4)
    assert states["hsdp"].grad_buckets == 0 and states["hsdp"].master == 0

    two = _fp32_plan(tiny(), gpus=2)
    tp, ddp = _row(two, "tp")[0].states, _row(two, "ddp")[0].states
    assert tp.trainable == 17_568 * 4 == 70_272  # 8,352 whole + 9,216 of the 18,432 split
    assert ddp.trainable - tp.trainable == 18_432 // 2 * 4  # only the split linears shrink
    # Gradients and AdamW follow their weights; TP alone has no DDP bucket copy.
    assert (tp.grads, tp.optimizer, tp.grad_buckets) == (70_272, 140_544, 0)


def test_lora_adapters_split_with_their_linears(tiny):
    tp = _row(_fp32_plan(tiny(), gpus=2, method="lora", lora_r=4), "tp")[0]
    # 1,792 whole adapter weights + 2,304 / 2 split ones
    assert (tp.states.frozen, tp.states.trainable) == (17_568 * 4, 2_944 * 4)
    assert tp.per_gpu()["lora"] == 2_944 * 4


def test_tp_splits_the_attention_and_mlp_activations_only(tiny):
    """fp32, per token: each norm 4h + 2eh = 384 bytes (2 a layer, whole); attention 5e*h_a + 4a = 656 and
    the MLP 4e*i = 1,024, split by TP. Two layers and the final norm, 64 tokens, no head counted here."""
    plan = _fp32_plan(tiny(), gpus=2)
    (ddp, _), (tp, _) = _row(plan, "ddp"), _row(plan, "tp")
    per_layer = {1: 2 * 384 + 656 + 1_024, 2: 2 * 384 + (656 + 1_024) // 2}
    assert ddp.activations - ddp.head == (2 * per_layer[1] + 384) * 64 == 337_920
    assert tp.activations - tp.head == (2 * per_layer[2] + 384) * 64 == 230_400
    assert tp.head == ddp.head  # the head stays whole on every TP rank


def test_communication_per_step_by_hand(tiny):
    """8 examples of 64 tokens a step, micro-batch 1, 4-byte weights, gradients and activations."""
    two = _fp32_plan(tiny(), gpus=2)
    # ddp: all-reduce of 26,784 x 4 gradient bytes over 2 ranks sends 2 x 1/2 of them.
    assert two.comm["ddp"] == 107_136
    # fsdp: GA 4; two gathers of the weights per micro-batch, one reduce-scatter, each sending half.
    assert two.comm["fsdp"] == (2 * 4 * 107_136 + 107_136) // 2 == 482_112
    # tp 2: 2 layers x 4 all-reduces of 512 tokens x 32 x 4 bytes, each sending 2 x 1/2 of it.
    assert _row(two, "tp")[1] == 2 * 4 * 512 * 32 * 4 == 524_288
    four = _fp32_plan(tiny(), gpus=4)
    # fsdp_tp 2x2: 2 data-parallel groups, so GA 4 and 256 tokens per TP pair; FSDP over 2 shards of the
    # 17,568-parameter TP rank.
    tp_part = 2 * 4 * 256 * 32 * 4
    assert _row(four, "fsdp_tp")[1] == tp_part + (2 * 4 * 70_272 + 70_272) // 2 == 578_368
    # hsdp 2x2: GA 2, FSDP within 2 shards, then an all-reduce of each half of the gradients across 2 copies.
    assert _row(four, "hsdp")[1] == (2 * 2 * 107_136 + 107_136) // 2 + 53_568 == 321_408


def test_checkpointing_repeats_the_forward_all_reduces(tiny):
    plan = make_plan(
        PlanRequest(model=tiny(), gpus=2, seq_len=64, global_batch=8, micro_batch=1, grad_ckpt="auto")
    )
    off, on = plan.layouts[0].comm
    assert on * 4 == off * 6


def test_tp_sends_far_more_than_ddp_at_long_sequences_on_two_gpus():
    request = PlanRequest(model=LLAMA3, gpus=2, seq_len=8192, global_batch=8, micro_batch=1, margin=0.0)
    plan = make_plan(request)
    tp = plan.layouts[0].comm[0]
    # 32 layers x 4 all-reduces of 8 x 8,192 tokens x 4,096 x 2 bytes; LoRA's fp32 gradients are 160 MiB.
    assert tp == 32 * 4 * 8 * 8192 * 4096 * 2
    assert tp > 100 * plan.comm["ddp"] and plan.comm["ddp"] == 41_943_040 * 4
    text = render_text(plan)
    assert f"tp 2 sends 64.0 GiB per GPU per step, {tp / plan.comm['ddp']:,.0f}x ddp's 160 MiB" in text
    assert "Without NVLink (e.g. 2x RTX 4090) prefer ddp, which fits" in text


def test_the_trade_off_names_tp_when_only_split_weights_fit_on_the_gpus():
    plan = make_plan(PlanRequest(model=LLAMA3, gpus=2, gpu_mem=22, grad_ckpt="off"))
    assert plan.choice.backend == "zero3_offload"
    assert "No data-parallel layout fits without offload but tp 2 does" in render_text(plan)


@pytest.mark.parametrize(
    "gpus, expected",
    [
        (1, []),
        (2, [Mesh("tp", tp=2)]),
        (3, [Mesh("tp", tp=3)]),
        (4, [Mesh("tp", tp=4), Mesh("fsdp_tp", tp=2, shard=2), Mesh("hsdp", shard=2, replicate=2)]),
        (8, [Mesh("tp", tp=8), Mesh("fsdp_tp", tp=2, shard=4), Mesh("hsdp", shard=4, replicate=2)]),
    ],
)
def test_meshes_by_gpu_count(gpus, expected):
    assert meshes(gpus) == expected
    assert all(mesh.gpus == gpus for mesh in expected)


def test_the_existing_rows_are_untouched_by_the_new_layouts(tiny):
    plan = _fp32_plan(tiny(), gpus=4)
    assert {row.backend for row in plan.rows} == set(memory.BACKENDS)
    assert set(plan.comm) == set(memory.BACKENDS) - {"single"}
    assert _fp32_plan(tiny(), gpus=1).layouts == () and _fp32_plan(tiny(), gpus=1).comm == {}


@pytest.mark.parametrize(
    "gpus, overrides, label, reason",
    [
        (4, {}, "tp 4", "tp 4 does not divide num_key_value_heads 2"),
        (2, {"intermediate_size": 65}, "tp 2", "tp 2 does not divide intermediate_size 65"),
        (
            2,
            {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3},
            "tp 2",
            "tp 2 does not divide num_attention_heads 3 or num_key_value_heads 3",
        ),
    ],
)
def test_sizes_tp_does_not_divide_are_refused_in_one_line(tiny, gpus, overrides, label, reason):
    plan = _fp32_plan(tiny(**overrides), gpus=gpus)
    refused = next(layout for layout in plan.layouts if layout.mesh.label == label)
    assert (refused.refusal, refused.rows, refused.comm) == (reason, (), ())
    text = render_text(plan)
    assert f"{label:33}no numbers: {reason}" in text.splitlines()
    assert not any(line.startswith(f"{label:14}grad ckpt") for line in text.splitlines())


def test_gpt2_has_no_tensor_parallel_plan(tmp_path, capsys):
    GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, bos_token_id=0, eos_token_id=0).to_json_file(
        tmp_path / "config.json"
    )
    argv = ["plan", "--model", str(tmp_path), "--gpus", "4", "--seq-len", "64", "--global-batch", "8"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "gpt2 has no tensor-parallel plan" in line]
    assert lines == [
        f"{'tp 4, fsdp_tp 2x2':33}no numbers: gpt2 has no tensor-parallel plan in transformers "
        "(base_model_tp_plan)"
    ]
    assert "\nhsdp 2x2      grad ckpt" in out and "\ntp 4 " not in out and "\nfsdp_tp 2x2 " not in out


def test_other_split_styles_and_qlora_are_refused():
    counts = count_parameters(tiny_llama_config(), "lora", 4)
    styled = dataclasses.replace(counts, tp_styles=("colwise", "replicated_with_grad_allreduce", "rowwise"))
    assert refusal(styled, Mesh("tp", tp=2)) == (
        "llama's tensor-parallel plan uses replicated_with_grad_allreduce; ftkit splits colwise/rowwise"
    )
    qlora = dataclasses.replace(counts, method="qlora")
    assert refusal(qlora, Mesh("tp", tp=2)) == "QLoRA's 4-bit weights are not split by tensor parallelism"
    assert refusal(qlora, Mesh("hsdp", shard=2, replicate=2)) is None


def test_json_lists_the_layouts_and_the_traffic(tiny):
    report = to_json(_fp32_plan(tiny(), gpus=4))
    layouts = {layout["backend"]: layout for layout in report["model_parallel"]}
    assert layouts["tp"]["refusal"] == "tp 4 does not divide num_key_value_heads 2"
    fsdp_tp = layouts["fsdp_tp"]
    assert (fsdp_tp["tp"], fsdp_tp["dp_shard"], fsdp_tp["grad_accum"]) == (2, 2, 4)
    assert fsdp_tp["rows"][0]["comm_bytes"] == 578_368
    assert layouts["hsdp"]["rows"][0]["model_state_bytes"]["trainable"] == 13_392 * 4
    assert report["comm_bytes"]["ddp"] == 3 * 107_136 // 2  # 2 x 3/4 of the gradients on 4 GPUs
    assert len(report["backends"]) == len(memory.BACKENDS)  # the data-parallel rows as before
