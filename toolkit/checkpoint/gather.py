"""The trained weights gathered a piece at a time, for a program that reads them each round (GRPO's engine):
a LoRA adapter's own parameters only, or the whole weights streamed a block at a time into one safetensors
file, never the whole model in memory at once.

What comes out is what export.py's `full_state_dict` gives (the same names, the same values): the adapter
as a state dict for PEFT's save_pretrained to write, the whole weights as the file safetensors' save_file
would write from it, byte for byte. ZeRO-3 gathers each piece with DeepSpeed's GatheredParameters, FSDP2 and
tensor parallelism with DTensor.full_tensor(), and a model whole on every process (one process, DDP, ZeRO-1
and 2) is read where it lies. FSDP1 and pipeline stages keep full_state_dict's whole gather: FSDP1 flattens
each wrapped layer's weights, the adapter's with its frozen base, into one parameter, whose smallest gather
is the whole layer (and its gather fails on CPU processes, see full_state_dict); a pipeline stage holds some
layers only, which full_state_dict brings together from every stage.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from toolkit.checkpoint.export import full_state_dict
from toolkit.distributed import unwrap
from toolkit.pipeline import stages

# Wrappers whose names torch's state-dict API drops from parameter names (full_state_dict's names under
# FSDP2 and tensor parallelism).
WRAPPER_NAMES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def adapter_state(accelerator, model) -> tuple[dict[str, torch.Tensor], int]:
    """Collective: the adapter's trained weights, whole on the main process ({} elsewhere), under the names
    full_state_dict gives them: what PEFT's save_pretrained keeps of full_state_dict's state; and the bytes
    gathered for it."""
    if not _by_parameter(accelerator, model) or _saves_untrained(unwrap(accelerator, model)):
        return _whole_model(accelerator, model)
    trained = [(name, t) for name, t in _entries(accelerator, model) if getattr(t, "requires_grad", False)]
    state, size = {}, 0
    with _gathered([t for _, t in trained]) as whole:
        for (name, _), tensor in zip(trained, whole, strict=True):
            size += _bytes(tensor)
            if accelerator.is_main_process:
                state[name] = tensor.detach().to("cpu", copy=True)
    return state, size


def stream_weights(accelerator, model, file: Path | None) -> int:
    """Collective: the whole weights written to `file` (by the main process; None: gathered, not written) as
    save_file writes full_state_dict's state, one block (a decoder layer, the embeddings) gathered at a
    time; a tied output head written too (vLLM's in-place reload leaves a head it finds no weight for as it
    was). Returns the bytes gathered."""
    unwrapped = unwrap(accelerator, model)
    if _by_parameter(accelerator, model):
        entries = dict(_entries(accelerator, model))
    else:
        state, size = _whole_model(accelerator, model)
        entries = state if accelerator.is_main_process else {}
        if not accelerator.is_main_process:
            return size
    tied = getattr(unwrapped.config, "tie_word_embeddings", False) and "lm_head.weight" not in entries
    if tied:
        entries["lm_head.weight"] = entries["model.embed_tokens.weight"]
    layout = _layout(entries)
    size = 0
    with contextlib.ExitStack() as stack:
        out = (
            stack.enter_context(open(file, "wb"))
            if file is not None and accelerator.is_main_process
            else None
        )
        if out is not None:
            _write_header(out, layout)
        for names in _blocks(layout):
            tensors = [entries[name] for name in names]
            with _gathered(tensors) as whole:
                for tensor in whole:
                    size += _bytes(tensor)
                    if out is not None:
                        out.write(_raw(tensor))
    return size


def write_weights(accelerator, model, folder: Path | None) -> int:
    """Collective: the whole weights as a Hugging Face checkpoint in `folder` (by the main process; None:
    gathered, not written): config.json and model.safetensors, streamed. Returns the bytes gathered."""
    if folder is not None and accelerator.is_main_process:
        folder.mkdir(parents=True, exist_ok=True)
        unwrap(accelerator, model).config.save_pretrained(str(folder))
    return stream_weights(accelerator, model, folder / "model.safetensors" if folder is not None else None)


def _by_parameter(accelerator, model) -> bool:
    """Whether each parameter can be gathered alone (not FSDP1's flat parameters, not a pipeline stage's
    part of the model, not DeepSpeed's own tensor parallelism inside ZeRO-3)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel) or stages.is_part(unwrap(accelerator, model)):
        return False
    autotp = getattr(model, "autotp_size", None)
    return not (autotp is not None and autotp() > 1)


def _saves_untrained(peft_model) -> bool:
    """Whether PEFT's save keeps weights the adapter does not train: biases (lora bias other than "none")
    or an adapted embedding's base weights. (It keeps the embeddings too when the vocabulary was resized,
    which ftkit never does.)"""
    config = peft_model.peft_config[peft_model.active_adapter]
    if getattr(config, "bias", "none") != "none":
        return True
    tuner = peft_model.base_model
    return any(
        isinstance(getattr(tuner.model.get_submodule(name), "base_layer", None), torch.nn.Embedding)
        for name in tuner.targeted_module_names
    )


def _whole_model(accelerator, model) -> tuple[dict[str, torch.Tensor], int]:
    """full_state_dict, and its bytes on this process."""
    state = full_state_dict(accelerator, model) or {}
    return state, sum(_bytes(t) for t in state.values())


def _entries(accelerator, model) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter or persistent buffer) in state-dict order, under full_state_dict's names."""
    unwrapped = unwrap(accelerator, model)
    entries = list(unwrapped.state_dict(keep_vars=True).items())
    if not any(isinstance(t, DTensor) for _, t in entries):
        return entries
    renamed = []
    for name, tensor in entries:
        for wrapper in WRAPPER_NAMES:
            name = name.replace(wrapper, "")
        renamed.append((name, tensor))
    return renamed


@contextlib.contextmanager
def _gathered(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Collective: `tensors` whole on every process until the block ends (ZeRO-3's partitions released
    then)."""
    partitioned = [t for t in tensors if hasattr(t, "ds_id")]
    context = contextlib.nullcontext()
    if partitioned:
        import deepspeed

        context = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)
    with context, torch.no_grad():
        yield [t.full_tensor() if isinstance(t, DTensor) else t.detach() for t in tensors]


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _layout(entries: dict[str, torch.Tensor]) -> dict[str, dict]:
    """safetensors' header of `entries` (its own order and dtype names, probed on empty tensors), with
    each tensor's whole shape and its data's offsets."""
    from safetensors.torch import save

    probe = save({name: torch.empty(0, dtype=t.dtype) for name, t in entries.items()})
    length = int.from_bytes(probe[:8], "little")
    layout, offset = {}, 0
    for name, about in json.loads(probe[8 : 8 + length]).items():
        shape = list(_whole_shape(entries[name]))
        end = offset + torch.Size(shape).numel() * entries[name].element_size()
        layout[name] = {"dtype": about["dtype"], "shape": shape, "data_offsets": [offset, end]}
        offset = end
    return layout


def _whole_shape(tensor: torch.Tensor) -> torch.Size:
    return tensor.ds_shape if hasattr(tensor, "ds_shape") else tensor.shape


def _write_header(out, layout: dict[str, dict]) -> None:
    header = json.dumps({"__metadata__": {"format": "pt"}, **layout}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    out.write(len(header).to_bytes(8, "little") + header)


def _blocks(layout: dict[str, dict]) -> Iterator[list[str]]:
    """The names in file order, in runs of one block each: a name's block is its prefix up to the first
    number (model.layers.3), or the name itself."""
    run, block = [], None
    for name in layout:
        parts = name.split(".")
        number = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        this = ".".join(parts[: number + 1]) if number is not None else name
        if run and this != block:
            yield run
            run = []
        run.append(name)
        block = this
    if run:
        yield run


def _raw(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as safetensors stores them (little-endian, row-major)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())
