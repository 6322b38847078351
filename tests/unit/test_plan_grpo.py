"""`ftkit plan --objective grpo`: a generation phase (kv cache, gathered weights, logits) beside training on
prompt + completion rows, the larger of the two deciding what fits, and a launch line for the GRPO recipe."""

import json
import shlex

import pytest

from toolkit.commands import cli
from toolkit.config import LossConfig
from toolkit.errors import UserError
from toolkit.grpo.config import load_grpo_config
from toolkit.launch.machine import GIB
from toolkit.plan.estimate import make_plan
from toolkit.plan.request import PlanRequest

# Llama-3-8B: 32 layers, 8 kv heads of 128, hidden 4096, MLP 14336, vocab 128,256; LoRA on bf16 weights.
GRPO = dict(
    model="meta-llama/Meta-Llama-3-8B",
    gpus=2,
    gpu_mem=24,
    method="lora",
    seq_len=1024,
    global_batch=32,
    micro_batch=1,
    objective="grpo",
    max_new_tokens=512,
)


def row(plan, backend, ckpt=True):
    return next(r for r in plan.rows if r.backend == backend and r.checkpointing == ckpt)


def grpo_plan(**changes):
    return make_plan(PlanRequest(**{**GRPO, **changes}))


def test_kv_cache_logits_and_prefill_by_hand():
    """32 completions a round over 2 GPUs: 16 rows each of 1024 prompt + 512 new tokens, all at once."""
    plan = grpo_plan()
    ddp = row(plan, "ddp").generation
    assert (ddp.rows, ddp.tokens) == (16, 1536)
    assert ddp.kv_cache == 2 * 32 * 8 * 128 * 2 * 16 * 1536  # K and V x layers x kv heads x dim x bf16
    # bf16 logits, generate's fp32 copy, the processor's fp32 scores, float64 uniforms + two temporaries
    assert ddp.logits == 16 * 128_256 * (2 + 4 + 4 + 3 * 8)
    assert ddp.prefill == 16 * 1024 * (2 * 4096 + 3 * 2 * 14336)  # residual stream + SwiGLU's three
    assert row(plan, "single").generation.rows == 32  # one process generates the whole round
    batched = row(grpo_plan(generation_batch=4), "ddp").generation
    assert batched.rows == 4 and batched.kv_cache * 4 == ddp.kv_cache


def test_a_bigger_round_raises_the_generation_peak_more_completions_per_prompt_do_not():
    base = row(grpo_plan(), "ddp")
    two_steps = row(grpo_plan(steps_per_generation=2), "ddp")
    assert two_steps.generation.kv_cache == 2 * base.generation.kv_cache
    assert two_steps.generation.total > base.generation.total
    assert two_steps.per_gpu()["training"] == base.per_gpu()["training"]
    longer = row(grpo_plan(max_new_tokens=1024), "ddp")
    assert longer.generation.kv_cache == base.generation.kv_cache * (1024 + 1024) // (1024 + 512)
    # A round is global batch x steps completions: G only groups them (4 prompts x 8 or 2 x 16).
    assert row(grpo_plan(generations=16), "ddp").generation == base.generation


def test_gathering_for_generation_adds_the_whole_model_under_zero3_and_fsdp_only():
    on, off = grpo_plan(), grpo_plan(gather_for_generation=False)
    counts = on.counts
    assert row(on, "zero3").generation.gathered == counts.total * 2  # DeepSpeed bf16: every weight
    assert row(on, "fsdp").generation.gathered == counts.frozen * 2 + counts.trainable * 4  # fp32 adapters
    assert row(on, "zero3").peak_phase == "generation"
    # Without it a sharded model gathers its layers one at a time, as training does.
    assert row(off, "zero3").generation.gathered == row(off, "zero3").working < counts.total // 4
    for backend in ("single", "ddp", "zero1", "zero2"):
        assert row(on, backend).generation.gathered == 0
        assert row(on, backend).generation == row(off, backend).generation


def test_a_separate_reference_costs_its_weights_in_both_phases_the_adapter_off_nothing():
    plain = grpo_plan()
    adapter_off = grpo_plan(beta=0.04)
    separate = grpo_plan(beta=0.04, reference_model=True)
    whole = plain.counts.total * 2  # bfloat16
    for backend, share in (("ddp", whole), ("zero3", whole // 2)):
        assert row(adapter_off, backend).per_gpu() == row(plain, backend).per_gpu()
        with_ref, without = row(separate, backend), row(plain, backend)
        assert with_ref.per_gpu()["reference"] == share
        assert with_ref.generation.resident - without.generation.resident == share


def test_the_larger_phase_is_the_total_and_decides_what_fits():
    """4096 new tokens: training (ckpt on) fits 24 GiB, the kv cache of 16 such rows does not."""
    long = row(grpo_plan(max_new_tokens=4096), "ddp")
    parts = long.per_gpu()
    assert parts["training"] < 24 * GIB < parts["generation"] == parts["total"]
    assert long.peak_phase == "generation"
    assert not grpo_plan(max_new_tokens=4096).fits(long)
    short = row(grpo_plan(max_new_tokens=64, generation_batch=1), "ddp", ckpt=False)
    parts = short.per_gpu()
    assert parts["generation"] < parts["training"] == parts["total"] and short.peak_phase == "training"
    training = ("weights", "lora", "grads", "optimizer", "activations", "overhead")
    assert parts["training"] == sum(parts[k] for k in training)


def test_training_rows_are_prompt_plus_completion_one_per_example():
    grpo = row(grpo_plan(), "ddp")
    sft = row(
        make_plan(PlanRequest(**{**GRPO, "objective": "sft", "seq_len": 1536, "max_new_tokens": 32})), "ddp"
    )
    assert grpo.activations - grpo.head == sft.activations - sft.head
    # The loss reads per-token log-probs: one chunk of logits and its bf16 gradient, nothing kept.
    assert grpo.head == min(LossConfig.chunk_tokens, 1536) * 128_256 * (4 + 2)


def test_tensor_parallel_ranks_split_the_kv_heads_and_pipelines_are_refused():
    plan = grpo_plan()
    tp = next(layout for layout in plan.layouts if layout.label == "tp 2")
    # tp 2 generates the whole round (one data-parallel group) with half the kv heads on each GPU.
    assert tp.rows[0].generation.rows == 32
    assert tp.rows[0].generation.kv_cache == row(plan, "ddp").generation.kv_cache
    pipelines = [layout for layout in plan.layouts if layout.mesh.pp > 1]
    assert pipelines and all("GRPO does not run on a pipeline" in p.refusal for p in pipelines)


def test_launch_line_runs_the_grpo_recipe_with_overrides_its_config_accepts(at_the_checkout_root):
    plan = grpo_plan(micro_batch=None, generations=4, beta=0.04)
    config = "recipes/configs/demo-grpo.yaml"
    assert f"recipes/grpo_llm.py --config {config} " in plan.command
    cfg = load_grpo_config(config, shlex.split(plan.command.split(config, 1)[1]))
    assert (cfg.model.path, cfg.model.adapter) == (GRPO["model"], None)  # the demo's adapter is not Llama's
    assert (cfg.grpo.num_generations, cfg.grpo.max_new_tokens, cfg.grpo.beta) == (4, 512, 0.04)
    assert (cfg.data.max_length, cfg.train.micro_batch_size) == (1024, plan.choice.micro_batch)


def test_text_and_json_show_the_generation_phase(capsys):
    argv = ["plan", "--model", GRPO["model"], "--gpus", "2", "--objective", "grpo", "--seq-len", "1024"]
    assert cli.main([*argv, "--max-new-tokens", "512"]) == 0
    out = capsys.readouterr().out
    assert "generation phase per GPU (GiB)" in out and "kv cache" in out and "gathered" in out
    assert "grpo     8 completions a prompt, 32 a round" in out
    assert ", peak in " in out.split("recommended:")[1]
    assert cli.main([*argv, "--max-new-tokens", "4096", "--json"]) == 1  # nothing fits 24 GiB
    report = json.loads(capsys.readouterr().out)
    ddp = next(b for b in report["backends"] if b["backend"] == "ddp" and b["gradient_checkpointing"])
    assert ddp["peak_phase"] == "generation"
    assert ddp["per_gpu_bytes"]["total"] == ddp["generation_bytes"]["total"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--generations", "4"], "--generations is for --objective grpo"),
        (["--objective", "dpo", "--max-new-tokens", "64"], "--max-new-tokens is for --objective grpo"),
        (["--no-gather-for-generation"], "--gather-for-generation is for --objective grpo"),
        (["--objective", "grpo", "--generations", "1"], "--generations must be >= 2, got 1"),
        (["--objective", "grpo", "--generations", "6"], "must be a multiple of --generations (6)"),
        (
            ["--objective", "grpo", "--reference-model"],
            "--reference-model with --objective grpo needs --beta",
        ),
        (["--objective", "grpo", "--method", "full", "--beta", "0.1"], "needs --reference-model"),
        (["--reference-model"], "--reference-model is for --objective dpo or grpo"),
        (["--engine", "own"], "--engine is for --objective grpo"),
        (["--objective", "grpo", "--engine", "own"], "--engine is for --generation vllm"),
        (["--objective", "grpo", "--gpu-memory-utilization", "0.5"], "is for --generation vllm"),
        (["--objective", "grpo", "--replicas", "2"], "--replicas is for --generation vllm"),
        (
            ["--objective", "grpo", "--generation", "vllm", "--replicas", "2"],
            "--replicas 2: copies of the engine run on GPUs of their own; add --engine own",
        ),
        (["--objective", "grpo", "--generation", "vllm", "--gpu-memory-utilization", "1.5"], "--gpu-memory-"),
    ],
)
def test_options_that_do_not_go_together_are_one_line_errors(capsys, options, message):
    assert cli.main(["plan", "--model", "Qwen/Qwen2.5-0.5B", *options]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_plan_request_refuses_the_same_without_the_command_line():
    with pytest.raises(UserError, match="--beta is for --objective grpo"):
        make_plan(PlanRequest(model="Qwen/Qwen2.5-0.5B", beta=0.1))


# The engine (grpo.generation vllm, toolkit/plan/engine.py) on Llama-3-8B, LoRA r=16 in bf16: its weights are
# every parameter, adapters included, x 2 bytes: W = 8,072,204,288 x 2 = 16,144,408,576. One row of 1024 +
# 512 tokens caches K and V x 32 layers x 8 kv heads x 128 x 2 bytes a token: 131,072 x 1536 = 201,326,592.
ENGINE_WEIGHTS = 8_072_204_288 * 2
ENGINE_ROW = 2 * 32 * 8 * 128 * 2 * 1536


def test_the_engine_shares_the_main_gpu_its_kv_cache_what_is_left_of_its_share():
    """2 x 80 GiB at U 0.3: the engine takes 24 GiB of the first GPU, K = 24 GiB - W = 9,625,395,200 bytes,
    47 rows of 1536 tokens (9,625,395,200 // 201,326,592 = 47.8); HF generate's phase is gone."""
    hf = grpo_plan(gpu_mem=80)
    plan = grpo_plan(gpu_mem=80, generation="vllm")
    engine = plan.engine
    assert (engine.weights, engine.row_cache, engine.share) == (ENGINE_WEIGHTS, ENGINE_ROW, 24 * GIB)
    assert engine.kv_cache == 24 * GIB - ENGINE_WEIGHTS == 9_625_395_200
    assert engine.rows == 47 and engine.starts and engine.shared
    for backend in ("ddp", "zero3"):
        with_engine, without = row(plan, backend), row(hf, backend)
        assert with_engine.generation is None and with_engine.engine == 24 * GIB
        # Training's parts are HF's; its peak is training's (the scoring pass stays under it) + the engine.
        assert with_engine.per_gpu()["total"] == without.per_gpu()["training"] + 24 * GIB
    assert row(hf, "zero3").peak_phase == "generation"  # gathering to generate, which the engine spares
    assert plan.choice is not None and plan.choice.engine == 24 * GIB


def test_an_engine_of_its_own_leaves_the_training_gpus_to_training():
    """At U 0.9 of a 24 GiB GPU of its own: 21.6 GiB, K = 23,192,823,398 - W = 7,048,414,822 bytes, 35
    rows (7,048,414,822 // 201,326,592 = 35.01)."""
    plan = grpo_plan(generation="vllm", engine="own", gpu_memory_utilization=0.9)
    engine = plan.engine
    assert engine.share == int(0.9 * 24 * GIB) == 23_192_823_398 and not engine.shared
    assert (engine.kv_cache, engine.rows) == (7_048_414_822, 35)
    ddp, hf = row(plan, "ddp"), row(grpo_plan(), "ddp").per_gpu()
    assert ddp.engine == 0 and "engine" not in ddp.per_gpu()
    assert ddp.per_gpu()["total"] == hf["training"]
    assert plan.choice is not None and "grpo.vllm.url=" in plan.command


def test_copies_of_the_engine_each_take_a_gpu_and_the_launch_line_names_them(at_the_checkout_root, capsys):
    """grpo.vllm.replicas 3 at U 0.9: 3 x 35 rows at once, the GPUs after training's named for them."""
    plan = grpo_plan(generation="vllm", engine="own", gpu_memory_utilization=0.9, replicas=3)
    assert (
        plan.engine.rows == 35
        and row(plan, "ddp").per_gpu()["total"] == row(grpo_plan(), "ddp").per_gpu()["training"]
    )
    config = "recipes/configs/demo-grpo.yaml"
    cfg = load_grpo_config(config, shlex.split(plan.command.split(config, 1)[1]))
    assert (cfg.grpo.vllm.replicas, cfg.grpo.vllm.gpus, cfg.grpo.vllm.url) == (3, "2,3,4", None)
    argv = ["plan", "--model", GRPO["model"], "--gpus", "2", "--objective", "grpo", "--generation", "vllm"]
    argv += ["--seq-len", "1024", "--max-new-tokens", "512", "--global-batch", "32", "--micro-batch", "1"]
    cli.main([*argv, "--engine", "own", "--replicas", "3", "--gpu-memory-utilization", "0.9"])
    out = capsys.readouterr().out
    assert "3 copies (grpo.vllm.replicas), a GPU each: 105 rows at once in all" in out
    assert "the run takes 2 training GPUs + 3" in out and "each of 3 GPUs of 24 GiB" in out


def test_the_engines_launch_line_is_a_config_the_recipe_accepts(at_the_checkout_root):
    plan = grpo_plan(gpu_mem=80, generation="vllm", gpu_memory_utilization=0.4)
    config = "recipes/configs/demo-grpo.yaml"
    cfg = load_grpo_config(config, shlex.split(plan.command.split(config, 1)[1]))
    assert (cfg.grpo.generation, cfg.grpo.vllm.gpu_memory_utilization, cfg.grpo.vllm.url) == (
        "vllm",
        0.4,
        None,
    )


def test_sharing_a_24_gib_gpu_the_8b_no_longer_fits(capsys):
    """HF generate fits 2 x 24 GiB; with the engine on the first GPU nothing does: at U 0.9 training (ddp,
    ckpt on, 19.5 GiB) + 21.6 GiB is past 24 x 0.95; at the default 0.3 its 7.2 GiB do not hold W (15.0)."""
    assert grpo_plan().choice is not None
    squeezed = grpo_plan(generation="vllm", gpu_memory_utilization=0.9)
    assert squeezed.engine.starts and squeezed.choice is None
    assert not any(squeezed.fits(r) for r in squeezed.rows)
    default = grpo_plan(generation="vllm")
    assert default.engine.kv_cache == 0 and not default.engine.starts and default.choice is None
    argv = ["plan", "--model", GRPO["model"], "--gpus", "2", "--objective", "grpo", "--seq-len", "1024"]
    assert cli.main([*argv, "--max-new-tokens", "512", "--generation", "vllm"]) == 1
    out = capsys.readouterr().out
    assert "the engine does not start" in out and "--engine own" in out
    assert cli.main([*argv, "--max-new-tokens", "512", "--generation", "vllm", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["engine"]["starts"] is False
