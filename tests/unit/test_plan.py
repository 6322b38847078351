"""`ftkit plan`: exact parameter counts, sharding arithmetic, recommendations, JSON output and cost."""

import dataclasses
import json

import huggingface_hub
import pytest
import torch
from helpers import tiny_llama_config
from transformers import LlamaForCausalLM

from toolkit.commands import cli
from toolkit.errors import UserError
from toolkit.plan import architectures, memory
from toolkit.plan.cost import CostRequest, estimate_cost, measured_tokens_per_s
from toolkit.plan.counts import count_parameters, load_model_config
from toolkit.plan.estimate import make_plan
from toolkit.plan.memory import FP32, model_state_bytes, token_activation_bytes
from toolkit.plan.request import PlanRequest

# The launch line names recipes/configs/ files, looked up where the line is run: a checkout's root.
pytestmark = pytest.mark.usefixtures("at_the_checkout_root")


@pytest.mark.parametrize("tied", [False, True])
def test_counts_equal_the_real_model(tied):
    config = tiny_llama_config(tie_word_embeddings=tied)
    torch.manual_seed(0)
    real = LlamaForCausalLM(config)
    counts = count_parameters(config, "full", lora_r=4)
    assert counts.total == counts.trainable == sum(p.numel() for p in real.parameters())
    assert counts.frozen == 0
    assert (counts.layers, counts.hidden, counts.heads, counts.kv_heads, counts.head_dim) == (2, 32, 4, 2, 8)
    assert counts.largest_layer == sum(p.numel() for p in real.model.layers[0].parameters())


@pytest.mark.filterwarnings("ignore::FutureWarning")  # raised inside peft, about transformers
def test_lora_trainable_count_equals_peft_on_a_real_model():
    from peft import LoraConfig, get_peft_model

    config = tiny_llama_config()
    real = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules="all-linear"))
    counts = count_parameters(config, "lora", lora_r=4)
    assert (counts.trainable, counts.total) == real.get_nb_trainable_parameters()
    assert counts.frozen == sum(p.numel() for p in LlamaForCausalLM(config).parameters())


def test_built_in_table_matches_published_parameter_counts():
    for model_id, published in architectures.PUBLISHED_PARAMS.items():
        config, source = load_model_config(model_id)
        total = count_parameters(config, "full", 16).total
        if isinstance(published, str):  # the card's rounded figure, "671B"
            decimals = len(published[:-1].partition(".")[2])
            assert round(total / 1e9, decimals) == float(published[:-1]), (model_id, total)
        else:
            assert total == published, model_id
        assert source == "built-in table"


@pytest.mark.parametrize(
    "model_id, kinds, kv_heads",
    [
        ("Qwen/Qwen3.5-9B", "24 gated DeltaNet + 8 attention layers", 4),
        ("google/gemma-4-31B-it", "60 attention layers", 16),
        ("nvidia/Nemotron-H-8B-Base-8K", "24 Mamba-2 + 4 attention + 24 feed-forward-only layers", 8),
    ],
)
def test_the_dense_2026_families_in_the_table_have_their_published_layouts(model_id, kinds, kv_heads):
    """The layer mix each card publishes, beside the rounded count above (which alone would not see a
    pattern cut short); the shapes are the checkpoints' (see the table's comments)."""
    counts = count_parameters(load_model_config(model_id)[0], "full", 16)
    assert (counts.layer_kinds, counts.kv_heads) == (kinds, kv_heads)


def test_the_shipped_gemma_4_config_fits_2x24_gb_as_its_header_says():
    from helpers import REPO

    from toolkit.plan.report import render_text
    from toolkit.recipes import load_any_recipe_config

    path = REPO / "recipes" / "configs" / "gemma-4-31b-qlora.yaml"
    cfg = load_any_recipe_config(path)
    request = PlanRequest(
        model=cfg.model.path,
        gpus=2,
        gpu_mem=24.0,
        method=cfg.model.method,
        grad_ckpt="on",
        micro_batch=cfg.train.micro_batch_size,
        seq_len=cfg.data.max_length,
        global_batch=cfg.train.global_batch_size,
    )
    plan = make_plan(request)
    assert (plan.choice.backend, plan.choice.checkpointing, plan.fits(plan.choice)) == ("fsdp", True, True)
    assert "--config recipes/configs/gemma-4-31b-qlora.yaml" in render_text(plan)
    assert "accelerate launch --config_file accelerate_configs/fsdp.yaml" in path.read_text()


def _counts(method: str, trainable: int, frozen: int, quantizable: int = 0):
    """Real counts of the small model with round numbers swapped in, so the arithmetic reads plainly."""
    counts = count_parameters(tiny_llama_config(), "full", 4)
    return dataclasses.replace(
        counts,
        method=method,
        trainable=trainable,
        frozen=frozen,
        total=trainable + frozen,
        quantizable=quantizable,
    )


@pytest.mark.parametrize(
    "backend, params, grads, buckets, optimizer, master",
    [
        # fp32 full fine-tune of 1,000 parameters on 2 ranks: 4 bytes a weight and a gradient, 8 for m + v.
        ("single", 4000, 4000, 0, 8000, 0),
        ("ddp", 4000, 4000, 4000, 8000, 0),  # DDP's buckets: a second gradient copy
        ("zero1", 4000, 4000, 0, 4000, 2000),  # optimizer sharded, plus DeepSpeed's cloned fp32 master shard
        ("zero2", 4000, 2000, 0, 4000, 2000),  # + gradients sharded
        ("zero3", 2000, 2000, 0, 4000, 2000),  # + parameters sharded
        ("fsdp", 2000, 2000, 0, 4000, 0),
        ("zero3_offload", 2000, 4000, 0, 4000, 2000),  # a second, fp32 gradient buffer for CPU Adam
    ],
)
def test_fp32_sharding_arithmetic(backend, params, grads, buckets, optimizer, master):
    states = model_state_bytes(_counts("full", 1000, 0), backend, 2, FP32)
    assert (states.frozen, states.trainable, states.grads, states.grad_buckets) == (0, params, grads, buckets)
    assert (states.optimizer, states.master, states.in_cpu_ram) == (
        optimizer,
        master,
        backend == "zero3_offload",
    )
    persistent = _counts("full", 1000, 0).zero3_persistent * 4
    assert states.persistent == (persistent if backend.startswith("zero3") else 0)
    # After the step only ZeRO-3 keeps its gradient partitions.
    assert states.after_step == states.total - (0 if backend.startswith("zero3") else grads)


def test_lora_states_and_odd_shards():
    counts = _counts("lora", trainable=101, frozen=10_000)
    ddp = model_state_bytes(counts, "ddp", 2)
    assert (ddp.frozen, ddp.trainable, ddp.grads, ddp.grad_buckets, ddp.optimizer) == (
        40_000,
        404,
        404,
        404,
        808,
    )
    # 101 trainable over 2 ranks: rank 0 holds 51.
    zero2 = model_state_bytes(counts, "zero2", 2)
    assert (zero2.trainable, zero2.grads, zero2.optimizer, zero2.master) == (404, 204, 408, 204)
    assert model_state_bytes(counts, "single", 8).total == 40_000 + 101 * 16


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("method", ["full", "lora"])
def test_single_process_states_equal_the_tensors_allocated(method):
    """One real AdamW step on CPU: every parameter, gradient and optimizer-state byte, counted."""
    from peft import LoraConfig, get_peft_model

    config = tiny_llama_config()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if method == "lora":
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
    tensors += [v for state in optimizer.state.values() for k, v in state.items() if k != "step"]
    allocated = sum(t.numel() * t.element_size() for t in tensors)
    assert model_state_bytes(count_parameters(config, method, 4), "single", 1).total == allocated


@pytest.fixture(scope="module")
def llama3_lora():
    return make_plan(PlanRequest(model="meta-llama/Meta-Llama-3-8B", gpus=2, gpu_mem=24, method="lora"))


def test_llama3_8b_lora_on_two_4090s_is_ddp_or_zero2_with_checkpointing(llama3_lora):
    choice = llama3_lora.choice
    assert choice.backend in ("ddp", "zero2") and choice.checkpointing
    assert choice.per_gpu()["total"] <= 24 * memory.GIB
    ga = llama3_lora.grad_accum(choice)
    assert choice.micro_batch * ga * 2 == 32
    command = llama3_lora.command
    assert command.startswith(f"accelerate launch --config_file accelerate_configs/{choice.backend}.yaml")
    assert (
        f"train.micro_batch_size={choice.micro_batch}" in command
        and "recipes/finetune_llm.py --config " in command
    )


def test_every_backend_is_estimated(llama3_lora):
    assert {row.backend for row in llama3_lora.rows} == set(memory.BACKENDS)
    by_name = {(r.backend, r.checkpointing): r.per_gpu()["total"] for r in llama3_lora.rows}
    assert by_name[("zero3", True)] < by_name[("ddp", True)] < by_name[("ddp", False)]


def test_full_llama3_8b_on_two_4090s_needs_offload_or_does_not_fit():
    request = PlanRequest(model="meta-llama/Meta-Llama-3-8B", gpus=2, gpu_mem=24, method="full")
    assert make_plan(request).choice.backend == "zero3_offload"
    assert make_plan(dataclasses.replace(request, cpu_mem=64)).choice is None


def test_json_output_parses(capsys, tmp_path):
    tiny_llama_config().to_json_file(tmp_path / "config.json")
    code = cli.main(
        [
            "plan",
            "--model",
            str(tmp_path),
            "--gpus",
            "2",
            "--gpu-mem",
            "8",
            "--seq-len",
            "64",
            "--global-batch",
            "8",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["model"]["source"] == str(tmp_path / "config.json")
    assert report["recommendation"]["config_file"] == "accelerate_configs/ddp.yaml"
    assert f"model.path={tmp_path}" in report["recommendation"]["command"]
    assert len(report["backends"]) == 2 * len(memory.BACKENDS)
    assert report["backends"][0]["per_gpu_bytes"]["total"] == sum(
        v for k, v in report["backends"][0]["per_gpu_bytes"].items() if k != "total"
    )


def test_text_output_names_every_backend(capsys):
    assert cli.main(["plan", "--model", "Qwen/Qwen2.5-0.5B", "--gpus", "2", "--grad-ckpt", "on"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n{backend} " in out for backend in memory.BACKENDS)
    assert "recommended: accelerate_configs/ddp.yaml" in out


def test_cost_arithmetic():
    cost = estimate_cost(CostRequest(tokens=36_000_000, tokens_per_s=10_000, price_per_gpu_hour=0.5), gpus=2)
    assert (cost.wall_hours, cost.gpu_hours, cost.price) == (1.0, 2.0, 1.0)
    assert estimate_cost(CostRequest(tokens=3_600, tokens_per_s=1.0), gpus=4).price is None


def test_cost_from_a_run(tmp_path):
    rates = [50.0, 1000.0, 1200.0, 1100.0]  # the first step is warm-up and left out
    lines = [{"step": i + 1, "loss": 2.0, "tokens_per_s": r} for i, r in enumerate(rates)]
    lines.insert(2, {"step": 2, "eval_loss": 1.9})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert measured_tokens_per_s(tmp_path) == 1100.0
    cost = estimate_cost(
        CostRequest(tokens=11_000 * 3600, from_run=str(tmp_path), price_per_gpu_hour=2.0), gpus=2
    )
    assert (cost.wall_hours, cost.price) == (10.0, 40.0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "nobody/no-such-model"], "not in the built-in table"),
        (["--model", "Qwen/Qwen2.5-0.5B", "--gpus", "3", "--global-batch", "32"], "not a multiple"),
        (["--model", "Qwen/Qwen2.5-0.5B", "--price-per-gpu-hour", "1"], "needs --tokens"),
        (["--model", "Qwen/Qwen2.5-0.5B", "--tokens", "1e6"], "--tokens-per-s X or --from-run"),
    ],
)
def test_bad_input_is_one_line(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # an unknown id never asks the hub
    assert cli.main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_missing_config_json_is_user_error(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        load_model_config(str(tmp_path))


def test_activation_offload_leaves_one_layer_on_the_gpu_and_moves_the_rest_to_cpu_ram():
    request = dict(model="meta-llama/Meta-Llama-3-8B", gpus=2, gpu_mem=24, seq_len=32768, micro_batch=1)
    kept = make_plan(PlanRequest(**request, grad_ckpt="on"))
    moved = make_plan(PlanRequest(**request, activation_offload=True))
    row = {r.backend: r for r in kept.rows}["zero3"]
    offloaded = {(r.backend, r.checkpointing): r for r in moved.rows}[("zero3", True)]
    layer, _, norm = token_activation_bytes(kept.counts, kept.precision)
    tokens = 32768
    assert offloaded.activations - offloaded.head == (layer + norm) * tokens
    assert offloaded.cpu_ram - row.cpu_ram == 2 * (row.activations - offloaded.activations)
    assert not kept.fits(row) and moved.fits(offloaded)  # 29.6 GiB without, 20.8 GiB with
    assert moved.choice.checkpointing  # tried first: only the layers' inputs travel to CPU RAM


def test_with_one_micro_batch_a_step_gradients_and_activations_do_not_peak_together():
    """On one H200 a 1B-shaped full fine-tune with one micro-batch a step peaked at 25.2 GB: the plan gave
    28.4 GB (1.13x) while it added every gradient to the activations; now 25.8 GB (1.02x)."""
    request = dict(model="meta-llama/Meta-Llama-3-8B", method="full", gpus=1, gpu_mem=80, micro_batch=1)
    one = make_plan(PlanRequest(**request, global_batch=1, grad_ckpt="off"))
    two = make_plan(PlanRequest(**request, global_batch=2, grad_ckpt="off"))
    single_one, single_two = one.rows[0], two.rows[0]
    assert single_one.backend == single_two.backend == "single"
    assert not single_one.grads_meet_activations and single_two.grads_meet_activations
    grads, activations = single_one.states.grads, single_one.activations
    parts = single_one.per_gpu()
    shown = sum(v for k, v in parts.items() if k != "total")
    assert parts["total"] == shown - min(grads, activations) and min(grads, activations) > 2**30
    assert two.rows[0].per_gpu()["total"] > parts["total"]
