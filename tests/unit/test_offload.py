"""Activation offload: the saved tensors leave the model's memory and come back bit for bit."""

import contextlib

import pytest
import torch
from helpers import tiny_llama_config
from transformers import LlamaForCausalLM

from toolkit.train.offload import MIN_BYTES, ActivationOffload


def gradients(checkpointing: bool, offload: ActivationOffload | None) -> tuple[torch.Tensor, float]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(hidden_size=128, intermediate_size=256, num_attention_heads=4))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (4, 128))
    with offload.hooks() if offload else contextlib.nullcontext():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]), loss.item()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_offloaded_activations_give_the_same_gradients_bit_for_bit(checkpointing):
    """On this CPU-only machine the hooks copy CPU tensors to new CPU memory, standing in for the move off
    a GPU: the forward's saved tensors are replaced by copies, and backward reads only those."""
    offload = ActivationOffload(torch.device("cpu"), copy_cpu_tensors=True)
    moved, moved_loss = gradients(checkpointing, offload)
    kept, kept_loss = gradients(checkpointing, None)
    assert offload.moved_bytes > 0
    assert moved_loss == kept_loss
    torch.testing.assert_close(moved, kept, rtol=0, atol=0)


def test_weights_small_tensors_and_cpu_tensors_stay_where_they_are():
    offload = ActivationOffload(torch.device("cpu"))
    big = torch.ones(MIN_BYTES)  # 4 bytes each: over the threshold
    assert offload.pack(big) is big and offload.moved_bytes == 0  # already in CPU memory
    copying = ActivationOffload(torch.device("cpu"), copy_cpu_tensors=True)
    weight = torch.nn.Parameter(torch.ones(MIN_BYTES))
    small = torch.ones(MIN_BYTES // 8)
    assert copying.pack(weight) is weight and copying.pack(small) is small
    device, host = copying.pack(big)
    assert host.data_ptr() != big.data_ptr() and copying.moved_bytes == big.numel() * 4
    assert torch.equal(copying.unpack((device, host)), big)
