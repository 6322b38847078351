"""Train a tiny random Llama for two optimizer steps under whatever backend `accelerate launch` asked for.

Writes losses, gradient norms and the final full state dict to --out, so a test can compare each backend with
one process. With --stock it builds a plain `Accelerator()` and records what `backend.verify` says.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import LlamaForCausalLM

from toolkit import distributed
from toolkit.checkpoint.export import full_state_dict
from toolkit.config import TrainConfig
from toolkit.entry import leave
from toolkit.errors import UserError
from toolkit.launch import backend
from toolkit.model import tensor_parallel
from toolkit.train import batches

# A launched script sees only its own folder; the shared test helpers are one up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import tiny_llama_config  # noqa: E402

# Clipping below the gradient norm, and not 1.0, so a backend that ignores train.max_grad_norm shows up.
TRAIN = TrainConfig(global_batch_size=8, micro_batch_size=2, max_grad_norm=0.3, learning_rate=1e-2)
STEPS = 2
SEQ_LEN = 16
VOCAB = 128


def build_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(vocab_size=VOCAB, max_position_embeddings=SEQ_LEN))


def build_loader() -> torch.utils.data.DataLoader:
    tokens = torch.randint(
        0, VOCAB, (TRAIN.global_batch_size * STEPS, SEQ_LEN), generator=torch.Generator().manual_seed(1)
    )
    return torch.utils.data.DataLoader(tokens, batch_size=TRAIN.micro_batch_size)


def train(accelerator: Accelerator) -> dict:
    model = build_model()
    if distributed.tensor_parallel_size(accelerator) > 1:
        tensor_parallel.parallelize(model, accelerator.torch_device_mesh["tp"], model.config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=TRAIN.learning_rate, weight_decay=0.0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, build_loader())
    losses, norms, micro_losses = [], [], []
    for tokens in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=tokens, labels=tokens).loss
            accelerator.backward(loss)
            micro_losses.append(loss.detach())
            if accelerator.sync_gradients:
                norms.append(float(distributed.clip_grad_norm(accelerator, model, TRAIN.max_grad_norm)))
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            losses.append(accelerator.reduce(torch.stack(micro_losses).mean(), "mean").item())
            micro_losses = []
    return {"losses": losses, "grad_norms": norms, "state_dict": full_state_dict(accelerator, model)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stock", action="store_true", help="plain Accelerator(), as a script without ftkit")
    args = parser.parse_args()
    launch = backend.detect_launch()
    if args.stock:
        accelerator = Accelerator()
        try:
            backend.verify(accelerator, launch)
            error = None
        except UserError as exc:
            error = str(exc)
        if accelerator.is_main_process:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "result.json").write_text(json.dumps({"error": error}))
        return
    ga = batches.grad_accum_steps(TRAIN, launch.mesh.data_parallel)
    accelerator = backend.setup(launch, TRAIN, grad_accum_steps=ga)
    result = train(accelerator)
    result["describe"] = backend.setup_summary(accelerator, launch, TRAIN, ga)
    if accelerator.is_main_process:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(
            {k: v.detach().float().cpu() for k, v in result.pop("state_dict").items()}, args.out / "model.pt"
        )
        deepspeed = accelerator.deepspeed_config if launch.backend == "deepspeed" else {}
        result |= {
            "distributed_type": accelerator.distributed_type.value,
            "world_size": accelerator.num_processes,
            "deepspeed": {
                k: deepspeed.get(k)
                for k in (
                    "train_batch_size",
                    "train_micro_batch_size_per_gpu",
                    "gradient_accumulation_steps",
                    "gradient_clipping",
                )
            },
        }
        (args.out / "result.json").write_text(json.dumps(result))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    leave(main)  # as the recipes end (toolkit/entry.py): no teardown with a gloo group alive
