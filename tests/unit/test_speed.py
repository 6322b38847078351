"""Optional speed features: used where the machine has them, a one-line note where not (the runs that
prove a working run and unchanged math are in tests/e2e)."""

import math
import re
from pathlib import Path

import pytest
import torch
from helpers import tiny_moe

from toolkit.config import ModelConfig, TrainConfig, load_config
from toolkit.errors import UserError
from toolkit.model import load as models
from toolkit.model.speed import resolve
from toolkit.train.metrics import read_metrics

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def features(device, installed=(), compiler=True, packing=False, layout=None, kernels=None, **settings):
    model = ModelConfig(**{k: v for k, v in settings.items() if k != "fused_adamw"})
    train = TrainConfig(**({"fused_adamw": settings["fused_adamw"]} if "fused_adamw" in settings else {}))
    return resolve(
        model,
        train,
        device,
        installed=lambda name: name in installed,
        has_compiler=lambda: compiler,
        kernels=kernels,
        packing=packing,
        compile_proven=layout is None,
    )


def test_defaults_compile_on_cuda_only_and_ask_for_nothing_unavailable():
    cpu, cuda = features(CPU), features(CUDA)
    assert (cpu.attention, cpu.liger, cpu.compile, cpu.notes) == ("sdpa", False, False, [])
    assert (cuda.attention, cuda.liger, cuda.compile, cuda.notes) == ("sdpa", False, True, [])
    assert cuda.fused_adamw and not cpu.fused_adamw  # auto: where the kernel exists


def test_auto_compile_stays_off_where_it_is_not_proven():
    assert not features(CUDA, layout="the zero3 layout").compile
    assert not features(CUDA, method="qlora").compile
    assert not features(CUDA, compiler=False).compile
    assert features(CUDA, layout="the zero3 layout", compile=True).compile  # asked for: it stands
    assert not features(CUDA, compile=False).compile


def test_auto_attention_is_flex_for_packed_rows_on_cuda():
    assert features(CUDA, packing=True).attention == "flex_attention"
    assert features(CPU, packing=True).attention == "sdpa"  # torch has no CPU backward for flex_attention
    no_flex = frozenset({"eager", "sdpa"})
    assert features(CUDA, packing=True, kernels=no_flex).attention == "sdpa"
    asked = features(CPU, attn_implementation="flex_attention")
    assert asked.attention == "sdpa" and asked.notes == [
        "model.attn_implementation: flex_attention trains on a CUDA GPU only; using sdpa"
    ]
    assert features(CUDA, attn_implementation="flex_attention").attention == "flex_attention"


def test_flash_attention_needs_cuda_and_the_package():
    assert (
        features(CUDA, {"flash_attn"}, attn_implementation="flash_attention_2").attention
        == "flash_attention_2"
    )
    on_cpu = features(CPU, {"flash_attn"}, attn_implementation="flash_attention_2")
    assert on_cpu.attention == "sdpa" and on_cpu.notes == [
        "model.attn_implementation: flash_attention_2 needs a CUDA GPU; using sdpa"
    ]
    missing = features(CUDA, attn_implementation="flash_attention_2")
    assert missing.attention == "sdpa" and "pip install flash-attn" in missing.notes[0]


def test_liger_compile_and_fused_adamw_fall_back_with_a_note():
    assert features(CUDA, {"liger_kernel"}, liger_kernels=True).liger
    assert "pip install liger-kernel" in features(CUDA, liger_kernels=True).notes[0]
    assert not features(CPU, {"liger_kernel"}, liger_kernels=True).liger
    assert features(CPU, compile=True).compile
    no_compiler = features(CPU, compiler=False, compile=True)
    assert not no_compiler.compile and "C++ compiler" in no_compiler.notes[0]
    asked = features(CPU, fused_adamw=True)
    assert not asked.fused_adamw and asked.notes == [
        "train.fused_adamw: the fused kernel needs a CUDA GPU; using the default AdamW"
    ]
    assert not features(CUDA, fused_adamw=False).fused_adamw


@pytest.mark.parametrize("key", ["model.gradient_checkpointing", "train.fused_adamw", "model.compile"])
def test_switches_take_true_false_or_auto(key):
    section, name = key.split(".")
    for text, value in (("true", True), ("false", False), ("auto", "auto")):
        got = getattr(getattr(load_config(None, [f"{key}={text}"]), section), name)
        assert (got, type(got)) == (value, type(value)), text
    with pytest.raises(UserError, match=f"{key}: 'sometimes' is not one of true, false, auto"):
        load_config(None, [f"{key}=sometimes"])


def test_auto_checkpointing_is_for_adapters_on_large_bases(monkeypatch):
    tiny = torch.nn.Linear(1000, 1000)  # 1,001,000 parameters
    assert not models.wants_checkpointing(ModelConfig(method="lora"), tiny)  # below 1B: activations are small
    monkeypatch.setattr(models, "AUTO_CHECKPOINTING_PARAMS", 1_000_000)
    assert models.wants_checkpointing(ModelConfig(method="lora"), tiny)
    assert not models.wants_checkpointing(ModelConfig(method="full"), tiny)
    assert models.wants_checkpointing(ModelConfig(method="full", gradient_checkpointing=True), tiny)


def test_an_attention_kernel_the_model_does_not_take_falls_back_to_eager_with_one_note():
    model, train = ModelConfig(path="m"), TrainConfig()
    got = resolve(model, train, CPU, kernels=frozenset({"eager", "flash_attention_2"}))
    assert got.attention == "eager" and got.notes == [
        "model.attn_implementation: m does not take sdpa; using eager"
    ]
    assert resolve(model, train, CPU, kernels=frozenset({"eager", "sdpa"})).notes == []


def assert_merged_equals_adapter(base: Path, final: Path) -> None:
    """The adapter loads in plain peft on the base, the merged export loads alone, and both give the same
    logits: the experts' update was merged into the right tensors."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    probe = torch.arange(5, 37).reshape(2, 16)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), final).eval()
    merged = AutoModelForCausalLM.from_pretrained(final / "merged").eval()
    with torch.no_grad():
        expected, got = adapted(input_ids=probe).logits, merged(input_ids=probe).logits
    trained = adapted.get_base_model()
    assert any(
        "experts" in name and "lora_B" in name and p.abs().max() > 0 for name, p in trained.named_parameters()
    )
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("signal_handlers_restored")
@pytest.mark.parametrize("model_type", ["gpt_oss", "qwen3_moe"])
def test_a_mixture_of_experts_trains_with_the_kernel_it_takes_and_its_router_balanced(
    model_type, recipe, tmp_path, capsys
):
    """gpt-oss's attention sinks have no SDPA kernel: a tiny random gpt-oss trains LoRA steps on eager, with
    the note, where asking for the default used to stop the load; Qwen3-MoE keeps SDPA. Both log the
    routers' balancing loss."""
    from toolkit.errors import run_main

    tiny_moe(tmp_path / "moe", model_type)
    argv = [f"model.path={tmp_path / 'moe'}", f"output_dir={tmp_path / 'run'}", "train.max_steps=2"]
    argv += ["data.max_length=64", "eval.exact_match_samples=0", "eval.max_batches=1", "export.merge=true"]
    assert run_main(recipe.main, argv, "finetune_llm") == 0
    out = capsys.readouterr().out
    assert out.count("does not take sdpa; using eager") == (model_type == "gpt_oss")
    assert_merged_equals_adapter(tmp_path / "moe", tmp_path / "run" / "final")
    assert "experts: 4 a layer, 2 per token, grouped_mm kernel; router balance" in out
    assert "trained: attention " in out
    assert re.search(r"trained: .*experts [\d,]+", out), "LoRA left the routed experts alone"
    logged = [line for line in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in line]
    assert logged[-1]["step"] == 2 and math.isfinite(logged[-1]["loss"])
    assert logged[-1]["router_aux_loss"] >= 2 * 0.99 and logged[-1]["expert_load_max"] >= 1.0


def test_threads_generating_at_once_leave_compilation_on_whatever_order_they_end_in():
    """Two threads inside `eager_blocks` at once, the first in leaving first (conversations answered
    concurrently with the model): compiled code runs eagerly while either is inside and compiles again once
    both are out."""
    import threading

    from torch._dynamo import eval_frame

    from toolkit.model.speed import eager_blocks

    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with eager_blocks():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second():
        first_in.wait(10)
        with eager_blocks():
            second_in.set()
            first_out.wait(10)
            seen["inside after the first left"] = eval_frame._stance.stance

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert seen == {"inside after the first left": "force_eager"}
    assert eval_frame._stance.stance == "default"
