"""toolkit/checkpoint/gather.py against what GRPO's engine sync wrote before it (full_state_dict, then PEFT's
save_pretrained or safetensors' save_file of the whole state): the same adapter folder and the same weights
file, byte for byte, on one process, under DDP (one gloo rank) and under FSDP2 (two), with the adapter's
bytes only gathered and the whole weights gathered a block at a time."""

import subprocess
import sys

import pytest
import torch
from accelerate import Accelerator
from helpers import REPO, free_port, launch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from toolkit.checkpoint import gather
from toolkit.checkpoint.export import full_state_dict, saver

MODEL = REPO / "toolkit" / "assets" / "tiny-llama-q64"


def lora_model() -> torch.nn.Module:
    """tiny-llama-q64 with rank-4 adapters on every linear layer, moved off their zero start."""
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=noise))
    return model


def full_model() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16)


def check_adapter(accelerator, model, folder) -> None:
    """The adapter folder written from the adapter's own weights is the one written from the whole state."""
    today = folder / "today"
    saver(accelerator, model).save_pretrained(str(today), state_dict=full_state_dict(accelerator, model))
    state, size = gather.adapter_state(accelerator, model)
    saver(accelerator, model).save_pretrained(str(folder / "now"), state_dict=state)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (folder / "now" / name).read_bytes() == (today / name).read_bytes(), name
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    # Rank 4 on q, k, v, o, gate, up, down (64x64, 32x64, 32x64, 64x64, 128x64, 128x64, 64x128) of two layers.
    assert size == sum(p.numel() * 4 for p in lora.values()) == 2 * 4 * (128 + 96 + 96 + 128 + 3 * 192) * 4
    assert sorted(state) == sorted(n.removeprefix("module.") for n in lora)


def check_weights(accelerator, model, folder, pieces: list) -> None:
    """The streamed weights file is the one save_file writes from the whole state (a tied head included),
    and no gather held more than one block."""
    state = full_state_dict(accelerator, model)
    tensors = {name: value.detach().cpu().clone().contiguous() for name, value in state.items()}
    save_file(tensors, str(folder / "today.safetensors"), metadata={"format": "pt"})
    size = gather.write_weights(accelerator, model, folder / "now")
    assert (folder / "now" / "model.safetensors").read_bytes() == (folder / "today.safetensors").read_bytes()
    assert (folder / "now" / "config.json").is_file()
    assert "lm_head.weight" in tensors  # the tied head, written as its own tensor
    assert size == sum(t.numel() * t.element_size() for t in tensors.values())
    whole = sum(t.numel() for t in tensors.values())
    assert len(pieces) >= 5 and max(pieces) < whole / 2, (pieces, whole)


@pytest.fixture
def pieces(monkeypatch) -> list[int]:
    """The elements of every gather."""
    seen, gathered = [], gather._gathered

    def counted(tensors):
        seen.append(sum(t.numel() for t in tensors))
        return gathered(tensors)

    monkeypatch.setattr(gather, "_gathered", counted)
    return seen


def test_one_process_writes_the_adapter_it_wrote_from_the_whole_state(tmp_path):
    check_adapter(Accelerator(cpu=True), lora_model(), tmp_path)


def test_an_adapted_embedding_is_saved_from_the_whole_state(tmp_path):
    """PEFT saves an adapted embedding's base weights too, which the adapter does not train: the sync
    gathers everything then, as before."""
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32),
        LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]),
    )
    accelerator = Accelerator(cpu=True)
    state, size = gather.adapter_state(accelerator, model)
    assert "base_model.model.model.embed_tokens.base_layer.weight" in state
    assert size == sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_one_process_streams_the_weights_file_save_file_wrote(tmp_path, pieces):
    check_weights(Accelerator(cpu=True), full_model(), tmp_path, pieces)


SCRIPT = """
import os, sys, pathlib
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
sys.path[:0] = ["tests", "tests/unit"]
from accelerate import Accelerator
import test_sync_gather as t
accelerator = Accelerator(cpu=True)
folder = pathlib.Path(sys.argv[2])
model = accelerator.prepare(t.lora_model())
assert type(model).__name__ == "DistributedDataParallel", type(model)
(folder / "lora").mkdir()
t.check_adapter(accelerator, model, folder / "lora")
pieces = []
original = t.gather._gathered
t.gather._gathered = lambda tensors: pieces.append(sum(x.numel() for x in tensors)) or original(tensors)
(folder / "full").mkdir()
t.check_weights(accelerator, accelerator.prepare(t.full_model()), folder / "full", pieces)
print("checked")
"""


def test_ddp_writes_the_same_adapter_and_weights(tmp_path):
    """In a process of its own (one gloo rank), the model wrapped in DistributedDataParallel."""
    env = {"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(free_port()), str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-3000:]


def test_fsdp2_on_two_processes_writes_the_same_adapter_and_weights(tmp_path):
    """Each DTensor gathered alone (tests/scripts/sync_gather_fsdp2.py): the folders full_state_dict gave."""
    script = REPO / "tests" / "scripts" / "sync_gather_fsdp2.py"
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", *launch("fsdp", 2), str(script), str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-3000:]
