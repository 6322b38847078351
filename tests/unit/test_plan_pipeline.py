"""`ftkit plan`'s pipelines (pp P, pp P x ddp D) by hand: what each stage holds, its memory under each
schedule, the bubble, and the bytes each GPU sends.

The small model (tests/helpers.py), fp32 throughout (4 bytes for everything), seq 64, micro-batch 1:
    parts       embeddings 4,096 (first stage); each layer 9,280 (9,216 linear + 2 norms of 32); final norm
                32 + head 4,096 = 4,128 (last stage)
    activations per token (see test_plan_parallel.py): a layer 2,448, the final norm 384; under
                checkpointing a layer keeps its input, 4 x 32 = 128
    loss head   chunked, per micro-batch of 64 tokens: a 64 x 128 fp32 chunk 32,768, and kept from forward
                to backward the hidden states' gradient 64 x 32 x 4 = 8,192 and the head weight's gradient
                128 x 32 x 4 = 16,384: 57,344 in all, 24,576 kept
    a boundary  the hidden states' gradient 64 x 32 x 4 = 8,192 bytes back; forward the hidden states and
                64 tokens x 24 bytes of position ids, mask and labels: 9,728
"""

import warnings
from fractions import Fraction

import pytest
import torch
from helpers import tiny_llama_config
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config

from toolkit.pipeline import stages
from toolkit.plan import comm, pipeline
from toolkit.plan.counts import build_meta_model
from toolkit.plan.estimate import make_plan
from toolkit.plan.parallel import Mesh
from toolkit.plan.pipeline import Pipe, gpu_counts, meshes
from toolkit.plan.report import render_text, to_json
from toolkit.plan.request import PlanRequest

LLAMA3 = "meta-llama/Meta-Llama-3-8B"
LAYER, NORM, KEPT, HEAD, HEAD_KEPT = 2_448, 384, 128, 57_344, 24_576
FORWARD, BACKWARD = 9_728, 8_192


# The launch line names recipes/configs/ files, looked up where the line is run: a checkout's root.
pytestmark = pytest.mark.usefixtures("at_the_checkout_root")


def _plan(model: str, gpus: int, **options):
    """fp32, no autocast, micro-batch 1, seq 64, 8 examples a step, checkpointing off unless given."""
    settings = dict(method="full", dtype="float32", mixed_precision="no", seq_len=64, global_batch=8)
    settings |= dict(micro_batch=1, grad_ckpt="off")
    return make_plan(PlanRequest(model=model, gpus=gpus, **{**settings, **options}))


def _layout(plan, label: str):
    return next(layout for layout in plan.layouts if layout.label == label)


def _gpus(plan, label: str, ckpt: bool = False) -> list:
    """Every GPU's estimate under the layout `label`, first stage first."""
    layout = _layout(plan, label)
    return [
        pipeline.estimate(plan.counts, layout.pipe, i, plan.request, plan.precision, ckpt, 1)
        for i in range(layout.mesh.pp)
    ]


@pytest.mark.parametrize(
    "gpus, m, schedule, chunks, bubble",
    [
        (2, 4, "gpipe", 1, Fraction(1, 5)),
        (2, 4, "1f1b", 1, Fraction(1, 5)),
        (2, 4, "interleaved_1f1b", 2, Fraction(1, 9)),
        (4, 8, "1f1b", 1, Fraction(3, 11)),
        (4, 8, "interleaved_1f1b", 2, Fraction(3, 19)),
    ],
)
def test_bubble_fractions(gpus, m, schedule, chunks, bubble):
    assert Pipe(Mesh("pp", pp=gpus), schedule, chunks, m).bubble == bubble


def test_micro_batches_in_flight_by_schedule():
    def in_flight(schedule: str, chunks: int = 1, m: int = 8) -> list:
        pipe = Pipe(Mesh("pp", pp=4), schedule, chunks, m)
        return [pipe.in_flight(i) for i in range(4)]

    assert in_flight("gpipe") == [8, 8, 8, 8]
    assert in_flight("1f1b") == [4, 3, 2, 1]
    # the 1f1b amount times 1 + 3/8
    assert in_flight("interleaved_1f1b", 2) == [
        Fraction(11, 2),
        Fraction(33, 8),
        Fraction(11, 4),
        Fraction(11, 8),
    ]
    assert in_flight("1f1b", m=2) == [2, 2, 2, 1]


@pytest.mark.parametrize(
    "gpus, labels",
    [
        (1, []),
        (2, ["pp 2"]),
        (3, ["pp 3"]),
        (4, ["pp 4", "pp 2 x ddp 2"]),
        (8, ["pp 8", "pp 4 x ddp 2", "pp 2 x ddp 4"]),
    ],
)
def test_pipeline_meshes_by_gpu_count(gpus, labels):
    assert [mesh.label for mesh in meshes(gpus)] == labels
    assert all(mesh.gpus == gpus for mesh in meshes(gpus))


def test_the_first_stage_holds_the_embeddings_and_the_last_the_head(tiny):
    plan = _plan(tiny(), gpus=2)
    pipe = _layout(plan, "pp 2 1f1b").pipe
    assert pipe.split == (1, 1)
    first, last = (gpu_counts(plan.counts, pipe, i) for i in range(2))
    assert (first.total, first.embed, first.lm_head, first.layers) == (4_096 + 9_280, 4_096, 0, 1)
    assert (last.total, last.embed, last.lm_head, last.layers) == (9_280 + 4_128, 0, 4_096, 1)
    states = [gpu.states for gpu in _gpus(plan, "pp 2 1f1b")]
    assert [s.trainable for s in states] == [13_376 * 4, 13_408 * 4]
    assert [(s.grads, s.optimizer, s.grad_buckets) for s in states] == [
        (53_504, 107_008, 0),
        (53_632, 107_264, 0),
    ]

    # LoRA r=4: each layer gets 2,048 adapter weights; embeddings and head stay frozen, on their own stages.
    lora = _plan(tiny(), gpus=2, method="lora", lora_r=4)
    first, last = (gpu_counts(lora.counts, _layout(lora, "pp 2 1f1b").pipe, i) for i in range(2))
    assert (first.frozen, first.trainable) == (4_096 + 9_280, 2_048)
    assert (last.frozen, last.trainable) == (9_280 + 4_128, 2_048)


def test_activations_by_schedule(tiny):
    """m = 8 micro-batches of 64 tokens on 2 stages of one layer each."""
    plan = _plan(tiny(), gpus=2)
    # 1f1b: stage 0 holds 2 micro-batches, the last 1, with the final norm and the loss head
    assert [gpu.activations for gpu in _gpus(plan, "pp 2 1f1b")] == [
        2 * LAYER * 64,
        (LAYER + NORM) * 64 + HEAD,
    ]
    # gpipe: all 8 on both; the head computes one chunk at a time but keeps its gradients for all 8
    gpipe = _gpus(plan, "pp 2 gpipe")
    assert [gpu.activations for gpu in gpipe] == [
        8 * LAYER * 64,
        8 * (LAYER + NORM) * 64 + HEAD + 7 * HEAD_KEPT,
    ]
    assert gpipe[1].head == HEAD + 7 * HEAD_KEPT
    # the full head: 64 x 128 logits at 12 bytes (logits, fp32 copy, log-softmax), the log-softmax kept
    full = _gpus(_plan(tiny(), gpus=2, loss_head="full"), "pp 2 gpipe")
    assert full[1].head == 64 * 128 * 12 + 7 * 64 * 128 * 4
    # the row is the worst GPU
    layout = _layout(plan, "pp 2 gpipe")
    assert layout.rows[0].per_gpu() == gpipe[1].per_gpu()
    assert layout.rows[0].per_gpu()["total"] == max(layout.gpu_totals[0])
    # checkpointing keeps each layer's input per micro-batch in flight, and recomputes one layer
    ckpt = _plan(tiny(), gpus=2, grad_ckpt="on")
    assert [gpu.activations for gpu in _gpus(ckpt, "pp 2 1f1b", ckpt=True)] == [
        2 * KEPT * 64 + LAYER * 64,
        (KEPT + NORM) * 64 + LAYER * 64 + HEAD,
    ]


def test_interleaved_chunks_and_activations(tiny):
    """4 layers as 4 chunks of 1: GPU 0 holds chunks 0 and 2, GPU 1 chunks 1 and 3."""
    plan = _plan(tiny(num_hidden_layers=4), gpus=2)
    pipe = _layout(plan, "pp 2 interleaved_1f1b").pipe
    assert (pipe.split, pipe.layer_ids(0), pipe.layer_ids(1)) == ((1, 1, 1, 1), [0, 2], [1, 3])
    assert [gpu_counts(plan.counts, pipe, i).total for i in range(2)] == [
        4_096 + 2 * 9_280,
        2 * 9_280 + 4_128,
    ]
    # in flight: 2 x (1 + 1/4) = 5/2 micro-batches on GPU 0, 5/4 on GPU 1
    assert [gpu.activations for gpu in _gpus(plan, "pp 2 interleaved_1f1b")] == [
        5 * 2 * LAYER * 64 // 2,
        5 * (2 * LAYER + NORM) * 64 // 4 + HEAD,
    ]


def test_pipeline_bytes_by_boundary():
    # 3 stages: the first sends forward, the middle both ways, the last back
    assert [comm.pipeline_bytes(3, 1, i, 4, 10, 1) for i in range(3)] == [40, 44, 4]
    # 2 GPUs x 2 chunks: GPU 0 holds chunks 0 and 2 (2 forward, 1 back), GPU 1 chunks 1 and 3 (1 and 2)
    assert [comm.pipeline_bytes(2, 2, i, 1, 10, 1) for i in range(2)] == [21, 12]


def test_bytes_sent_per_step(tiny):
    """The busiest GPU, m = 8 micro-batches (4 under pp 2 x ddp 2)."""
    two = _plan(tiny(), gpus=2)
    assert _layout(two, "pp 2 1f1b").comm == (8 * FORWARD,) == (77_824,)
    assert _layout(two, "pp 2 gpipe").comm == (77_824,)
    # the runtime pads every micro-batch to data.max_length rounded up to 8: seq 60 travels as 64
    assert _layout(_plan(tiny(), gpus=2, seq_len=60), "pp 2 1f1b").comm == (77_824,)
    four_layers = tiny(num_hidden_layers=4)
    interleaved = _layout(_plan(four_layers, gpus=2), "pp 2 interleaved_1f1b")
    assert interleaved.comm == (8 * (2 * FORWARD + BACKWARD),)
    four = _plan(four_layers, gpus=4)
    assert _layout(four, "pp 4 1f1b").comm == (8 * (FORWARD + BACKWARD),)  # a middle stage
    # pp 2 x ddp 2, GPU 0: 4 micro-batches forward, then an all-reduce of its 22,656 x 4 gradient bytes
    # over 2 copies, which sends them once
    assert _layout(four, "pp 2 x ddp 2 1f1b").comm == (4 * FORWARD + 22_656 * 4,)


def test_preference_pairs_run_two_rows_an_example(tiny):
    """DPO: 128-token micro-batches; the head recomputes its chunk in backward (a 128 x 128 chunk and its
    gradient, 8 bytes an entry), keeping nothing else."""
    plan = _plan(tiny(), gpus=2, objective="dpo")
    assert _layout(plan, "pp 2 1f1b").comm == (2 * 77_824,)
    assert [gpu.activations for gpu in _gpus(plan, "pp 2 1f1b")] == [
        2 * LAYER * 128,
        (LAYER + NORM) * 128 + 128 * 128 * 8,
    ]


def test_pp_rows_for_two_and_four_gpus(tiny):
    two = render_text(_plan(tiny(), gpus=2)).splitlines()
    assert any(line.startswith("pp 2          grad ckpt off") and "1f1b  11.1%" in line for line in two)
    assert any(line.startswith("pp 2          grad ckpt off") and "gpipe  11.1%" in line for line in two)
    assert f"{'pp 2 interleaved_1f1b':33}no numbers: 2 chunks on each of 2 GPUs need 4 decoder layers" in two
    assert (
        "  pp 2: layers 1 | 1; 8 micro-batches a step; GiB by GPU under 1f1b, grad ckpt off: 1.0 | 1.0" in two
    )

    four = render_text(_plan(tiny(num_hidden_layers=8), gpus=4)).splitlines()
    rows = [line for line in four if line.startswith("pp ")]
    assert [row[:27] for row in rows] == ["pp 4          grad ckpt off"] * 3 + [
        "pp 2 x ddp 2  grad ckpt off"
    ] * 3
    bubbles = [row.split()[-2] for row in rows]
    assert bubbles == ["27.3%", "27.3%", "15.8%", "20.0%", "20.0%", "11.1%"]  # 3/11, 3/19; 1/5, 1/9


def test_the_trade_off_names_the_pipeline_against_fsdp_and_zero3():
    plan = make_plan(PlanRequest(model=LLAMA3, gpus=2, seq_len=2048, global_batch=8, micro_batch=1))
    sent = _layout(plan, "pp 2 1f1b").comm[0]
    assert sent == 8 * (2048 * 4096 * 2 + 2048 * 24)  # bf16 hidden states, 8 micro-batches
    assert sent * 100 < plan.comm["fsdp"] and sent * 100 < plan.comm["zero3"]
    text = render_text(plan)
    assert "  Without NVLink (e.g. 2x RTX 4090) prefer ddp, which fits" in text
    line = (
        "  A pipeline sends only activations between neighbouring stages: pp 2 1f1b 128 MiB per GPU per step"
    )
    assert line in text
    assert "it pays with its bubble instead (11.1% of each GPU idle" in text


@pytest.mark.parametrize(
    "gpus, shape, options, refused, reason",
    [
        (
            2,
            {"tie_word_embeddings": True},
            {},
            "pp 2",
            "the model ties its output head to its input embeddings",
        ),
        (4, {}, {}, "pp 4", "the model has 2 decoder layers, fewer than 4 stages"),
        (2, {}, {"method": "qlora"}, "pp 2", "a pipeline refuses QLoRA (model.method qlora)"),
        (
            2,
            {},
            {"objective": "dpo", "reference_model": True},
            "pp 2",
            "a pipeline refuses a separate reference model (dpo.reference_model)",
        ),
    ],
)
def test_what_the_runtime_cannot_split_is_refused(tiny, gpus, shape, options, refused, reason):
    plan = _plan(tiny(**shape), gpus=gpus, **options)
    layout = _layout(plan, refused)
    assert layout.refusal.startswith(reason) and (layout.rows, layout.comm) == ((), ())
    text = render_text(plan).splitlines()
    assert any(line.startswith(f"{refused:33}no numbers: {reason}") for line in text)
    assert not any(line.startswith(f"{refused:14}grad ckpt") for line in text)


def test_model_types_the_runtime_does_not_split_are_refused(tmp_path):
    GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, bos_token_id=0, eos_token_id=0).to_json_file(
        tmp_path / "config.json"
    )
    layout = _layout(_plan(str(tmp_path), gpus=2), "pp 2")
    assert layout.refusal.startswith("model type gpt2 is not split into pipeline stages")


def test_the_split_is_the_runtimes(tiny):
    """Embeddings and head of 32,000 weights (vocab 1000) against layers of 11,328 (LoRA r=4) over 3 stages:
    the end stages take one layer each, the middle four, as the runtime splits the model itself."""
    model = tiny(vocab_size=1000, num_hidden_layers=6)
    plan = _plan(model, gpus=3, global_batch=9, method="lora", lora_r=4)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft calls a deprecated transformers method
        meta = get_peft_model(
            build_meta_model(tiny_llama_config(vocab_size=1000, num_hidden_layers=6)),
            LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"),
        )
    assert _layout(plan, "pp 3 1f1b").pipe.split == (1, 4, 1) == tuple(stages.layer_split(meta, 3, []))


def test_json_lists_the_pipelines(tiny):
    report = to_json(_plan(tiny(), gpus=2))
    piped = [layout for layout in report["model_parallel"] if layout["pp"] == 2]
    assert [layout["schedule"] for layout in piped] == ["gpipe", "1f1b", "interleaved_1f1b"]
    one_f_one_b = piped[1]
    assert (one_f_one_b["backend"], one_f_one_b["grad_accum"], one_f_one_b["stage_layers"]) == (
        "pp",
        8,
        [1, 1],
    )
    assert one_f_one_b["bubble"] == pytest.approx(1 / 9)
    row = one_f_one_b["rows"][0]
    assert row["comm_bytes"] == 77_824 and len(row["per_gpu_total_bytes"]) == 2
    assert row["per_gpu_bytes"]["total"] == max(row["per_gpu_total_bytes"])
    assert piped[2]["refusal"] == "2 chunks on each of 2 GPUs need 4 decoder layers"
