"""Checkpoints outlive their launch: `ftkit export` turns a checkpoint of any backend into the same files the
run's own final/ export holds, and a run resumes under another world size or backend.

Launches: started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher): what the runs compute
is what is tested, not how they start.
"""

import shutil

import pytest
import torch
from helpers import REPO, launch, run_recipe, step_losses
from safetensors.torch import load_file

from toolkit.checkpoint import CONFIG
from toolkit.commands import cli

# Warmup off, so the steps around the resume move the weights enough for Adam's moments to matter; 5 steps,
# a checkpoint at 3.
SETTINGS = {
    "lora": [
        "model.method=lora",
        "train.learning_rate=1e-3",
        "train.warmup_steps=0",
        "train.save_every_steps=3",
        "train.max_steps=5",
    ],
    "full": [
        "model.method=full",
        "train.learning_rate=1e-4",
        "train.warmup_steps=0",
        "train.save_every_steps=3",
        "train.max_steps=5",
    ],
}
RUNS = {  # name -> (accelerate config, processes, method, extra overrides)
    "ddp": ("ddp", 2, "lora", ["export.merge=true"]),
    "fsdp": ("fsdp", 2, "lora", []),
    "zero2": ("zero2", 2, "lora", []),
    "zero3": ("zero3", 2, "full", []),
}
# Odd, so that a launch with another accumulation (one process where two had one micro-batch each) resumes
# mid-way through what its own accumulation would count: accelerate's micro-batch count must follow.
RESUME_AT = 3  # of 5 steps


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """name -> output_dir of a run in RUNS, trained once for the whole module when first asked for."""
    done = {}

    def get(name: str):
        if name not in done:
            config, processes, method, extra = RUNS[name]
            out = tmp_path_factory.mktemp(name) / "run"
            run_recipe(out, *SETTINGS[method], *extra, launch=launch(config, processes))
            done[name] = out
        return done[name]

    return get


def tensors(directory) -> dict[str, torch.Tensor]:
    adapter = (directory / "adapter_config.json").is_file()
    return load_file(directory / ("adapter_model.safetensors" if adapter else "model.safetensors"))


def assert_same_tensors(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].numel() > 0, name
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["ddp", "fsdp", "zero3"])
def test_export_of_the_last_checkpoint_equals_the_runs_final_export(name, trained, tmp_path):
    run = trained(name)
    checkpoint = run / "checkpoints" / "step-5"
    assert (checkpoint / CONFIG).is_file()  # self-describing: base model and method travel with it
    out = tmp_path / "export"
    assert cli.main(["export", str(checkpoint), "--out", str(out)]) == 0
    assert_same_tensors(tensors(out), tensors(run / "final"))


@pytest.mark.multiproc
def test_exported_adapter_loads_with_peft_and_merges_like_the_recipe(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = trained("ddp")
    checkpoint = run / "checkpoints" / "step-5"
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert cli.main(["export", str(checkpoint), "--out", str(adapter), "--dtype", "bf16"]) == 0
    assert {t.dtype for t in tensors(adapter).values()} == {torch.bfloat16}
    base = AutoModelForCausalLM.from_pretrained(REPO / "toolkit" / "assets" / "tiny-llama")
    model = PeftModel.from_pretrained(base, str(adapter))
    name, weight = next((n, p) for n, p in model.named_parameters() if "lora_B" in n)
    assert weight.abs().sum() > 0, name  # trained, not the zero initialisation

    assert cli.main(["export", str(checkpoint), "--out", str(merged), "--merge-lora"]) == 0
    assert not (merged / "adapter_config.json").exists()
    assert_same_tensors(tensors(merged), tensors(run / "final" / "merged"))


def resume_copy(source, tmp_path):
    """A copy of a run stopped after RESUME_AT: its later checkpoints and final export removed."""
    out = tmp_path / "resumed"
    shutil.copytree(source, out)
    shutil.rmtree(out / "final")
    for path in (out / "checkpoints").glob("step-*"):
        if int(path.name[5:]) > RESUME_AT:
            shutil.rmtree(path)
    return out


# (source run, target config, target processes): every pair carries the optimizer moments by name. Four
# processes take micro-batches of 2 for the same global batch of 8. A DCP state into a plain optimizer is
# tests/e2e/test_model_parallel.py's tp-to-ddp. ZeRO-3 into DDP was folded: ZeRO-3's moments are read as in
# zero3 -> fsdp2 (and QLoRA's zero3 -> single, tests/e2e/test_qlora.py), and moments into a plain optimizer
# as in zero2 -> single.
RESUMES = {
    "ddp world 2 -> single world 1": ("ddp", "single", 1),
    "zero2 -> single": ("zero2", "single", 1),
    "zero3 -> fsdp2": ("zero3", "fsdp", 2),
    "fsdp2 -> zero2": ("fsdp", "zero2", 2),
    "ddp -> zero3 world 4": ("ddp", "zero3", 4),
}
MICRO = {4: ["train.micro_batch_size=2"]}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", list(RESUMES))
def test_resume_under_another_world_size_or_backend_continues_the_run(case, trained, tmp_path):
    source_name, config, processes = RESUMES[case]
    source = trained(source_name)
    out = resume_copy(source, tmp_path)
    settings = SETTINGS[RUNS[source_name][2]] + MICRO.get(processes, [])
    result = run_recipe(out, *settings, launch=launch(config, processes))
    assert f"at step {RESUME_AT}" in result.stdout
    assert "optimizer moments restart" not in result.stdout
    straight, resumed = step_losses(source), step_losses(out)
    assert len(resumed) == len(straight) == 5
    # The first resumed step's loss is computed before its update: it sees only the restored weights. The
    # next ones follow Adam updates, which land elsewhere unless both moments and the step count carried
    # over (restarted moments make the update lr * sign(g) per weight instead of lr * m / sqrt(v)).
    assert resumed[RESUME_AT:] == pytest.approx(straight[RESUME_AT:], rel=1e-5)
