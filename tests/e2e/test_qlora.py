"""QLoRA on this CPU, as a user launches it: one process, DDP, FSDP2 and ZeRO-3 take the same steps, a
ZeRO-3 run resumes exactly, and any backend's checkpoint exports as an adapter or merged into the
dequantized 4-bit base.

Launches: started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher): what the runs compute
is what is tested.
"""

import shutil

import pytest
import torch
from helpers import REPO, launch, run_recipe, step_losses
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from toolkit.commands import cli
from toolkit.model import quant

Q64 = REPO / "toolkit" / "assets" / "tiny-llama-q64"
QLORA = [f"model.path={Q64}", "model.method=qlora", "train.learning_rate=2e-3", "train.save_every_steps=2"]
RUNS = {"single": ("single", 1), "ddp": ("ddp", 2), "fsdp2": ("fsdp", 2), "zero3": ("zero3", 2)}
PER_STEP = 1e-3  # the loss of every step, against one process
RESUME_AT = 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """name -> output_dir of the QLoRA run in RUNS, trained once for the whole module when first asked."""
    done = {}

    def get(name: str):
        if name not in done:
            config, processes = RUNS[name]
            out = tmp_path_factory.mktemp(name) / "run"
            run_recipe(out, *QLORA, launch=launch(config, processes))
            done[name] = out
        return done[name]

    return get


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["ddp", "fsdp2", "zero3"])
def test_every_backend_takes_the_steps_of_one_process(name, trained):
    reference, losses = step_losses(trained("single")), step_losses(trained(name))
    assert len(losses) == len(reference) == 4
    assert reference[-1] < reference[0]  # it trains
    assert losses == pytest.approx(reference, abs=PER_STEP)


@pytest.mark.multiproc
@pytest.mark.parametrize("config, processes", [("zero3", 2), ("single", 1)])
def test_a_zero3_run_resumes_exactly_on_zero3_or_one_process(config, processes, trained, tmp_path):
    """On ZeRO-3 through DeepSpeed's own loader; on one process through the portable path (the 4-bit
    base's packed weights and the adapter's moments read back from ZeRO-3's partitions)."""
    source = trained("zero3")
    out = tmp_path / "resumed"
    shutil.copytree(source, out)
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoints" / "step-4")
    result = run_recipe(out, *QLORA, launch=launch(config, processes))
    assert f"at step {RESUME_AT}" in result.stdout
    assert "optimizer moments restart" not in result.stdout
    assert step_losses(out) == pytest.approx(step_losses(source), rel=1e-5 if processes == 1 else 1e-6)


def adapter(directory):
    return load_file(directory / "adapter_model.safetensors")


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["fsdp2", "zero3"])
def test_a_sharded_checkpoint_exports_the_runs_adapter(name, trained, tmp_path):
    run = trained(name)
    out = tmp_path / "adapter"
    assert cli.main(["export", str(run / "checkpoints" / "step-4"), "--out", str(out)]) == 0
    got, final = adapter(out), adapter(run / "final")
    assert got.keys() == final.keys() and got
    for key, tensor in final.items():
        torch.testing.assert_close(got[key], tensor, rtol=0, atol=0, msg=key)


def export(run, out, *flags) -> dict:
    """`ftkit export` of the run's last checkpoint to `out`; the tensors written."""
    assert cli.main(["export", str(run / "checkpoints" / "step-4"), "--out", str(out), *flags]) == 0
    return load_file(out / "model.safetensors")


def dequantized_base(name: str) -> torch.Tensor:
    """The 4-bit base's weight `name` as QLoRA trained over it, dequantized to float32."""
    model = AutoModelForCausalLM.from_pretrained(
        Q64, dtype=torch.float32, quantization_config=quant.quant_config(torch.uint8), device_map={"": "cpu"}
    )
    return model.dequantize(dtype=torch.float32).state_dict()[name]


@pytest.mark.multiproc
def test_the_merged_export_is_the_dequantized_base_plus_the_adapter_and_generates(trained, tmp_path):
    run = trained("fsdp2")
    merged = export(run, tmp_path / "merged", "--merge-lora", "--dtype", "fp32")
    name = "model.layers.1.mlp.down_proj.weight"
    lora, prefix = adapter(run / "final"), "base_model.model.model.layers.1.mlp.down_proj"
    delta = lora[f"{prefix}.lora_B.weight"] @ lora[f"{prefix}.lora_A.weight"] * (32 / 16)  # alpha / r
    assert delta.abs().max() > 0
    base = dequantized_base(name)
    torch.testing.assert_close(merged[name], base + delta)
    # Not the original base: its distance to the NF4 values dwarfs the float rounding above.
    original = AutoModelForCausalLM.from_pretrained(Q64, dtype=torch.float32).state_dict()[name]
    assert (merged[name] - original - delta).abs().max() > 10 * (merged[name] - base - delta).abs().max()
    bf16 = export(run, tmp_path / "bf16", "--merge-lora", "--dtype", "bf16")
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
    prompt = ["--prompt", "What is 2 + 3?", "--max-new-tokens", "4"]
    assert cli.main(["generate", "--model", str(tmp_path / "merged"), *prompt]) == 0
    assert cli.main(["generate", "--model", str(run / "final"), *prompt]) == 0
