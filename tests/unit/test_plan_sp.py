"""`ftkit plan` for long sequences: Ulysses sequence parallelism under ZeRO (zero2/zero3 + sp N, sp 2 x dp D),
its all-to-all traffic by hand, the attention heads it needs, and `--longest-seq`, the longest sequence each
setup and layout fits.

The issue's case: LoRA of Llama-3-8B (32 heads, 8 kv heads of 128, 32 layers) at 32k tokens on 2 x 24 GiB,
2 examples a step. At micro-batch 1 each GPU of sp 2 runs 2 micro-batches of 16,384 tokens a step; each
attention layer sends (sp-1)/sp = 1/2 of q and the output (32 x 128 each) and k and v (8 x 128 each) per
token in bf16, in forward, backward and (checkpointing) the recomputed forward:
    32 layers x 3 x 2 micro-batches x 16,384 tokens x 2 bytes x 2 x (32 + 8) x 128 / 2 = 30 GiB
"""

import dataclasses

import pytest

from toolkit.commands import cli
from toolkit.launch.machine import GIB
from toolkit.plan import comm, sequence
from toolkit.plan.estimate import make_plan
from toolkit.plan.longest import LIMIT, STEP, longest_fitting
from toolkit.plan.report import render_text, to_json
from toolkit.plan.request import PlanRequest

LLAMA3 = "meta-llama/Meta-Llama-3-8B"
LONG = PlanRequest(model=LLAMA3, gpus=2, gpu_mem=24, seq_len=32768, global_batch=2, micro_batch=1)

# The launch line names recipes/configs/ files, looked up where the line is run: a checkout's root.
pytestmark = pytest.mark.usefixtures("at_the_checkout_root")


@pytest.fixture(scope="module")
def long_plan():
    """The issue's case, every checkpointing option, with the longest sequence of each layout."""
    return make_plan(dataclasses.replace(LONG, longest_seq=True))


def _layout(plan, label: str):
    return next(layout for layout in plan.layouts if layout.label == label)


def _row(plan, label: str, ckpt: bool):
    """The row of a layout or data-parallel backend `label` with checkpointing `ckpt`."""
    rows = _layout(plan, label).rows if " + sp " in label else plan.rows
    name = label if " + sp " not in label else _layout(plan, label).mesh.backend
    return next(row for row in rows if row.backend == name and row.checkpointing == ckpt)


def test_sp_rows_appear_on_two_gpus_and_sp_x_dp_from_four(tiny):
    request = PlanRequest(model=tiny(), gpus=2, seq_len=256, global_batch=8, grad_ckpt="on")
    two = make_plan(request)
    sp = [layout for layout in two.layouts if layout.mesh.sp > 1]
    assert [(layout.label, layout.mesh.backend, layout.refusal) for layout in sp] == [
        ("zero2 + sp 2", "sp", None),
        ("zero3 + sp 2", "sp_zero3", None),
    ]
    assert all(len(layout.rows) == 1 for layout in sp)
    text = render_text(two)
    assert "\nzero2 + sp 2  grad ckpt on " in text and "\nzero3 + sp 2  grad ckpt on " in text
    assert "accelerate_configs/sp.yaml" in text and "accelerate_configs/sp_zero3.yaml" in text
    four = make_plan(dataclasses.replace(request, gpus=4))
    labels = [layout.label for layout in four.layouts if layout.mesh.sp > 1]
    assert labels == ["zero2 + sp 4", "zero3 + sp 4", "zero3 + sp 2 x dp 2"]
    files = {layout["config_file"] for layout in to_json(four)["model_parallel"] if layout["sp"] > 1}
    assert files == {f"accelerate_configs/{name}.yaml" for name in ("sp", "sp_zero3", "sp_dp")}


def test_activations_per_gpu_at_sp_2_are_half_the_zero_rows(long_plan):
    for zero in ("zero2", "zero3"):
        for ckpt in (False, True):
            whole, split = _row(long_plan, zero, ckpt), _row(long_plan, f"{zero} + sp 2", ckpt)
            # The layers' activations halve exactly; the chunked head's one chunk of 512 tokens stays.
            assert 2 * (split.activations - split.head) == whole.activations - whole.head
            assert 0.5 < split.activations / whole.activations < 0.55
            assert split.states == whole.states  # sharded by the ZeRO stage over both GPUs, as zero's


def test_the_all_to_alls_by_hand(long_plan):
    layout = _layout(long_plan, "zero3 + sp 2")
    ckpt = [row.checkpointing for row in layout.rows]
    a2a = dict(zip(ckpt, layout.all_to_all))
    assert (a2a[True], a2a[False]) == (30 * GIB, 20 * GIB)
    # ZeRO-3's gathers and reduce-scatters over both GPUs, for 2 micro-batches a step, come on top.
    zero = comm.data_parallel_bytes(long_plan.counts, "zero3", 2, 2, long_plan.precision)
    assert dict(zip(ckpt, layout.comm)) == {True: 30 * GIB + zero, False: 20 * GIB + zero}
    assert "(all-to-all 30.0 GiB/step)" in render_text(long_plan)
    # One kv head, fewer than sp 2: DeepSpeed repeats it, so k and v go as 2 heads each.
    one_kv = dataclasses.replace(long_plan.counts, kv_heads=1)
    per_token = 2 * (32 + 2) * 128 * 2 // 2  # q, output, k and v in bf16, half of it leaving
    assert comm.ulysses_bytes(one_kv, 2, 1000, False, long_plan.precision) == 32 * 2 * 1000 * per_token


@pytest.mark.parametrize(
    "gpus, kv_heads, reason",
    [
        (4, 6, "sp 4 does not divide num_attention_heads 6 (Ulysses splits the heads)"),
        (2, 3, "sp 2 and num_key_value_heads 3: neither divides the other"),
    ],
)
def test_heads_sp_does_not_divide_get_no_sp_rows_but_a_reason(tiny, gpus, kv_heads, reason):
    """6 heads of 8 (hidden 48): sp 4 does not divide them; sp 2 does, but not 3 kv heads, nor they it."""
    model = tiny(hidden_size=48, num_attention_heads=6, num_key_value_heads=kv_heads)
    plan = make_plan(PlanRequest(model=model, gpus=gpus, seq_len=256, global_batch=8))
    split = [layout for layout in plan.layouts if layout.mesh.sp == gpus]
    assert len(split) == 2 and all(layout.refusal.startswith(reason) for layout in split)
    assert all(layout.rows == () for layout in split)
    text = render_text(plan)
    line = next(line for line in text.splitlines() if "no numbers: " + reason in line)
    assert line.startswith(f"zero2 + sp {gpus}, zero3 + sp {gpus} ")
    assert f"\nzero2 + sp {gpus}  grad ckpt" not in text


def test_sequence_parallelism_runs_the_sft_and_preference_recipes(tiny):
    plan = make_plan(PlanRequest(model=tiny(), gpus=2, seq_len=256, global_batch=8, objective="grpo"))
    refusals = {layout.refusal for layout in plan.layouts if layout.mesh.sp > 1}
    assert refusals == {"sequence parallelism runs the SFT and preference recipes; grpo is refused"}
    plan = make_plan(PlanRequest(model=tiny(), gpus=2, seq_len=256, global_batch=8, objective="dpo"))
    assert all(layout.rows for layout in plan.layouts if layout.mesh.sp > 1)


def test_llama3_8b_lora_at_32k_fits_two_24gb_gpus_without_offload(long_plan):
    split = [layout for layout in long_plan.layouts if layout.mesh.sp > 1]
    fitting = [row for layout in split for row in layout.rows if long_plan.fits(row)]
    assert [(row.backend, row.checkpointing) for row in fitting] == [("sp_zero3", True)]
    row = fitting[0]
    assert not row.states.in_cpu_ram and 20 * GIB < row.per_gpu()["total"] < 21.5 * GIB  # 20.8 GiB
    # Neither data-parallel ZeRO-3 (29.6 GiB) nor ZeRO-2 with sp 2 (27.1 GiB) fits; only offload did.
    assert not long_plan.fits(_row(long_plan, "zero3", True))
    assert not long_plan.fits(_row(long_plan, "zero2 + sp 2", True))
    assert long_plan.choice.backend == "zero3_offload"
    assert "  without offload: zero3 + sp 2 fits, gradient checkpointing on, 20.8 of 24 GiB" in render_text(
        long_plan
    )


def test_longest_sequence_is_the_edge_of_the_estimate_and_sp_2_goes_further(long_plan):
    longest = long_plan.longest
    assert longest["zero3 + sp 2"] > longest["zero3"] > 0 and longest["zero3 + sp 2"] >= 32768
    assert longest["zero2 + sp 2"] > longest["zero2"]
    assert all(tokens % STEP == 0 for tokens in longest.values())
    # At its longest zero3 + sp 2 fits, 1024 tokens more it does not.
    for seq_len, fits in ((longest["zero3 + sp 2"], True), (longest["zero3 + sp 2"] + STEP, False)):
        at = dataclasses.replace(LONG, seq_len=seq_len)
        mesh, precision = _layout(long_plan, "zero3 + sp 2").mesh, long_plan.precision
        rows = [sequence.estimate(long_plan.counts, mesh, at, precision, c, 1) for c in (False, True)]
        assert any(long_plan.fits(row) for row in rows) == fits
    text = render_text(long_plan)
    assert f"\n  {'zero3 + sp 2':30}{longest['zero3 + sp 2']:>10,} *" in text  # past Llama-3's 8,192


def test_longest_fitting_bisects_each_name():
    calls = []

    def fits_at(seq_len: int) -> dict[str, bool]:
        calls.append(seq_len)
        return {"some": seq_len <= 5000, "all": True, "none": False}

    assert longest_fitting(fits_at) == {"some": 4096, "all": LIMIT, "none": 0}
    assert len(calls) == len(set(calls)) <= 2 + 2 * 10  # each length once; about log2(1024) per name


def test_longest_seq_on_the_command_line(tiny, capsys):
    argv = ["plan", "--model", tiny(), "--gpus", "2", "--seq-len", "256", "--global-batch", "8"]
    assert cli.main([*argv, "--gpu-mem", "2", "--longest-seq"]) == 0
    out = capsys.readouterr().out
    assert "\nlongest  --seq-len that fits 2 GiB per GPU at micro-batch 1" in out
    assert "\n  zero3 + sp 2 " in out and "\n  ddp " in out
    assert cli.main([*argv, "--json"]) == 0
    assert '"longest_seq": null' in capsys.readouterr().out
