"""Measure the model-state bytes one rank holds under whatever backend `accelerate launch` asked for.

Builds a random Llama of the requested size (as `ftkit plan` would count it), trains two AdamW steps on
random tokens, and sums the storage of every live tensor on this rank, less what was alive before the model
was built: once after the second backward pass (parameters + gradients + optimizer states) and once after
its optimizer step. Writes {rank: bytes} and the model's config to --out.
"""

import argparse
import gc
import json
import sys
import warnings
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, LlamaConfig

from toolkit.config import TrainConfig
from toolkit.entry import leave
from toolkit.launch import backend, request

# A launched script sees only its own folder; the shared test helpers are one up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import tiny_llama_config  # noqa: E402

SIZES = {
    "small": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, vocab_size=512),
    "large": dict(hidden_size=128, intermediate_size=320, num_hidden_layers=4, vocab_size=1024),
}
LORA_R = 8
TRAIN = TrainConfig(global_batch_size=4, micro_batch_size=2, max_grad_norm=1.0)
SEQ_LEN = 16


def model_config(size: str) -> LlamaConfig:
    return tiny_llama_config(**SIZES[size], max_position_embeddings=SEQ_LEN)


def build_model(config: LlamaConfig, method: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = get_peft_model(
                model, LoraConfig(r=LORA_R, target_modules="all-linear", task_type="CAUSAL_LM")
            )
    return model


def live_tensor_bytes(extra=()) -> int:
    """Bytes of every distinct storage reachable as a Python tensor object (or passed in `extra`)."""
    gc.collect()
    seen, total = set(), 0
    with warnings.catch_warnings():  # isinstance() on some library objects warns about deprecated aliases
        warnings.simplefilter("ignore")
        objects = [obj for obj in [*gc.get_objects(), *extra] if isinstance(obj, torch.Tensor)]
    for obj in objects:
        if obj.device.type == "meta":
            continue
        local = obj.to_local() if isinstance(obj, DTensor) else obj
        try:
            storage = local.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if storage.data_ptr() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=sorted(SIZES), required=True)
    parser.add_argument("--method", choices=["full", "lora"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    launch = backend.detect_launch()
    accelerator = backend.setup(launch, TRAIN, grad_accum_steps=1)
    tokens = torch.randint(
        0, 100, (TRAIN.micro_batch_size, SEQ_LEN), generator=torch.Generator().manual_seed(1)
    )
    baseline = live_tensor_bytes([tokens])

    config = model_config(args.size)
    model = build_model(config, args.method)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(2):
        accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        after_backward = live_tensor_bytes([tokens, *grads]) - baseline
        del grads
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after_step = live_tensor_bytes([tokens]) - baseline

    measured = torch.tensor([after_backward, after_step], dtype=torch.float64)
    gathered = accelerator.gather(measured.unsqueeze(0)).tolist()
    if accelerator.is_main_process:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "model_config": config.to_dict(),
                    "lora_r": LORA_R,
                    "after_backward": [int(row[0]) for row in gathered],
                    "after_step": [int(row[1]) for row in gathered],
                    "backend": request.backend_name(launch),
                }
            )
        )
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    leave(main)  # as the recipes end (toolkit/entry.py): no teardown with a gloo group alive
