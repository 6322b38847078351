"""Under torchrun (2 gloo processes): a tiny float64 Llama with LoRA on every linear layer, split by
`tensor_parallel.parallelize`, against the same model whole on each process. Writes the largest difference
of the loss and of every parameter's gradient (split ones gathered whole) to --out as JSON."""

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from peft import get_peft_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import LlamaForCausalLM

from toolkit.config import LoraConfig
from toolkit.entry import leave
from toolkit.model import tensor_parallel
from toolkit.model.load import peft_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import tiny_llama_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    config = tiny_llama_config()
    base = LlamaForCausalLM(config).double()
    dense = get_peft_model(base, peft_config(LoraConfig(target_modules="all-linear", dropout=0.0), base))
    for name, param in dense.named_parameters():  # B starts at zero: give every adapter a gradient path
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    split = copy.deepcopy(dense)
    tensor_parallel.parallelize(split, init_device_mesh("cpu", (2,)), config)
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (dense, split):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        losses.append(loss.item())
    grads = dict(dense.named_parameters())
    worst, names = 0.0, 0
    for name, param in split.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        worst = max(worst, (grad - grads[name].grad).abs().max().item())
        names += 1
    split_names = sum(isinstance(p, DTensor) for p in split.parameters())
    if dist.get_rank() == 0:
        result = {"loss_diff": abs(losses[0] - losses[1]), "grad_diff": worst, "grads": names}
        args.out.write_text(json.dumps({**result, "split_params": split_names}))


if __name__ == "__main__":
    leave(main)  # as the recipes end (toolkit/entry.py): no teardown with a gloo group alive
