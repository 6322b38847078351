"""Launched on two gloo processes under FSDP2 (tests/unit/test_sync_gather.py): the adapter's own weights and
the streamed weights file, each DTensor gathered alone, give the folders full_state_dict gave."""

import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import save_file

sys.path[:0] = [str(Path(__file__).parents[1]), str(Path(__file__).parents[1] / "unit")]
import test_sync_gather as checks  # noqa: E402

from toolkit.checkpoint import gather  # noqa: E402
from toolkit.checkpoint.export import full_state_dict, saver  # noqa: E402
from toolkit.launch.fsdp import cpu_fsdp_plugin, switch_on_cpu_fsdp  # noqa: E402


def prepared(accelerator, model):
    """`model` under FSDP2 (which takes an optimizer with it)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return accelerator.prepare(model, torch.optim.SGD(trained, lr=0.1))[0]


def main(folder: Path) -> None:
    accelerator = Accelerator(cpu=True, fsdp_plugin=cpu_fsdp_plugin(2))
    switch_on_cpu_fsdp(accelerator, 2)
    model = prepared(accelerator, checks.lora_model())
    state = full_state_dict(accelerator, model)
    adapter, size = gather.adapter_state(accelerator, model)
    assert size == 32768 and type(model).__name__ == "FSDPPeftModel", (size, type(model))
    full = prepared(accelerator, checks.full_model())
    whole = full_state_dict(accelerator, full)
    gather.write_weights(accelerator, full, folder / "now" if accelerator.is_main_process else None)
    if accelerator.is_main_process:
        saver(accelerator, model).save_pretrained(str(folder / "today"), state_dict=state)
        saver(accelerator, model).save_pretrained(str(folder / "now"), state_dict=adapter)
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            assert (folder / "now" / name).read_bytes() == (folder / "today" / name).read_bytes(), name
        tensors = {name: value.detach().cpu().clone().contiguous() for name, value in whole.items()}
        save_file(tensors, str(folder / "today.safetensors"), metadata={"format": "pt"})
        assert (folder / "now" / "model.safetensors").read_bytes() == (
            folder / "today.safetensors"
        ).read_bytes()
        print("checked")
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
