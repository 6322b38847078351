"""The recipe end to end on the embedded tiny model, one process: train, save, export, reload, resume.

Launches: started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher): what the runs compute
is what is tested.
"""

import json
import shutil

import pytest
import torch
from helpers import run_recipe, step_losses
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from toolkit.checkpoint import MARKER
from toolkit.checkpoint.export import verify_export
from toolkit.commands.cli import main as ftkit
from toolkit.train.metrics import read_metrics

LORA_RUN = ["train.save_every_steps=2", "export.merge=true", "eval.exact_match_samples=2"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    return out, run_recipe(out, *LORA_RUN)


def test_lora_run_writes_every_contracted_output(lora_run):
    out, result = lora_run
    assert (out / "config.yaml").is_file()
    lines = read_metrics(out / "metrics.jsonl")
    train_lines = [r for r in lines if "loss" in r]
    assert [r["step"] for r in train_lines] == [1, 2, 3, 4]
    for key in (
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "tokens_per_s_per_device",
        "tokens_seen",
        "step_time_s",
        "peak_mem_mb",
    ):
        assert all(isinstance(r[key], float | int) for r in train_lines), key
    assert all(r["tokens_per_s_per_device"] == r["tokens_per_s"] for r in train_lines)  # one process
    assert not any("mfu" in r for r in train_lines)  # no peak FLOP/s is known for a CPU
    assert all(0 <= r["data_wait_frac"] < 1 for r in train_lines)
    assert all(r["peak_mem_mb"] > 100 for r in train_lines)  # a Python process with torch loaded
    evals = [r for r in lines if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 4] and all("exact_match" in r for r in evals)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
    assert json.loads((out / "checkpoints" / "step-4" / MARKER).read_text())["step"] == 4
    final = out / "final"
    for name in (
        "adapter_model.safetensors",
        "adapter_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (final / name).is_file(), name
    assert "saved:" in result.stdout and "[before]" in result.stdout and "[after]" in result.stdout


def test_lora_adapter_is_trained_and_loads(lora_run):
    out, _ = lora_run
    adapter = load_file(out / "final" / "adapter_model.safetensors")
    lora_b = [t for name, t in adapter.items() if "lora_B" in name]
    assert lora_b and all(t.numel() > 0 for t in adapter.values())
    assert any(t.abs().sum() > 0 for t in lora_b), "lora_B starts at zero; training must move it"
    assert verify_export(out / "final") == len(adapter)

    from peft import AutoPeftModelForCausalLM

    peft_model = AutoPeftModelForCausalLM.from_pretrained(out / "final")
    merged = AutoModelForCausalLM.from_pretrained(out / "final" / "merged")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    torch.testing.assert_close(merged(ids).logits, peft_model(ids).logits, rtol=1e-4, atol=1e-4)


def test_generate_cli_answers_with_the_adapter(lora_run, capsys):
    out, _ = lora_run
    assert (
        ftkit(
            ["generate", "--model", str(out / "final"), "--prompt", "What is 2 + 2?", "--max-new-tokens", "4"]
        )
        == 0
    )
    assert capsys.readouterr().out.strip()


def test_full_finetune_exports_a_loadable_model(tmp_path):
    out = tmp_path / "full"
    run_recipe(out, "model.method=full", "train.learning_rate=1e-4")
    final = out / "final"
    assert (final / "model.safetensors").is_file() and (final / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(final)
    base = AutoModelForCausalLM.from_pretrained("toolkit/assets/tiny-llama")
    moved = [
        n
        for (n, p), (_, q) in zip(model.named_parameters(), base.named_parameters())
        if not torch.equal(p, q)
    ]
    assert moved, "full fine-tuning must change the weights"


def test_micro_batch_and_accumulation_do_not_change_the_loss(tmp_path):
    run_recipe(tmp_path / "a", "train.micro_batch_size=8")
    run_recipe(tmp_path / "b", "train.micro_batch_size=2")
    a, b = step_losses(tmp_path / "a"), step_losses(tmp_path / "b")
    assert len(a) == 4
    assert a == pytest.approx(b, rel=1e-5)


def test_resume_continues_exactly(lora_run, tmp_path):
    straight, _ = lora_run
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    # Pretend the run died after step 2: drop everything it wrote later, then launch again.
    shutil.rmtree(resumed / "checkpoints" / "step-4")
    shutil.rmtree(resumed / "final")
    result = run_recipe(resumed, *LORA_RUN)
    assert "resumed from" in result.stdout and "step-2 at step 2" in result.stdout
    assert step_losses(resumed) == step_losses(straight)
    assert len(step_losses(resumed)) == 4
    final_a = load_file(straight / "final" / "adapter_model.safetensors")
    final_b = load_file(resumed / "final" / "adapter_model.safetensors")
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
