"""Gradient accumulation must not change the math: the step's gradient is that of the mean over every
label token in the global batch, however it is split into micro-batches."""

import pytest
import torch
from accelerate import Accelerator
from helpers import micro_llama

from toolkit.train.loss import IGNORE, backward_scale, count_targets, summed_token_loss

GLOBAL_BATCH = 8


def variable_length_batch(seed=0, length=12, vocab=64):
    """8 rows whose label counts differ wildly (2 to 11 tokens), right-padded with ignored labels."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (GLOBAL_BATCH, length), generator=gen)
    labels = ids.clone()
    for row, real in enumerate([3, 12, 5, 12, 4, 9, 7, 11]):
        labels[row, real:] = IGNORE
    return ids, labels


def step_gradient(micro: int, naive: bool = False) -> torch.Tensor:
    """One optimizer step's gradient through Accelerator.backward, as the recipe computes it."""
    grad_accum = GLOBAL_BATCH // micro
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=grad_accum)
    model = accelerator.prepare(micro_llama().double())
    ids, labels = variable_length_batch()
    chunks = list(zip(ids.split(micro), labels.split(micro)))
    scale = backward_scale(sum(count_targets(lab) for _, lab in chunks), grad_accum, world_size=1)
    for chunk_ids, chunk_labels in chunks:
        with accelerator.accumulate(model):
            logits = model(input_ids=chunk_ids).logits
            summed = summed_token_loss(logits, chunk_labels)
            loss = summed / count_targets(chunk_labels) if naive else summed * scale
            accelerator.backward(loss)
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_accumulation_splits_give_equal_gradients():
    reference = step_gradient(micro=8)
    for micro in (2, 1):
        torch.testing.assert_close(step_gradient(micro), reference, rtol=1e-10, atol=1e-12)


def test_naive_per_micro_batch_mean_is_caught():
    """The same comparison on the usual mean-per-micro-batch loss fails: the test above can fail."""
    reference = step_gradient(micro=8)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(step_gradient(micro=2, naive=True), reference, rtol=1e-10, atol=1e-12)


def test_summed_loss_matches_mean_cross_entropy():
    model = micro_llama().double()
    ids, labels = variable_length_batch()
    logits = model(input_ids=ids).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), labels[:, 1:].reshape(-1))
    summed = summed_token_loss(logits, labels).item()
    assert summed / count_targets(labels) == pytest.approx(expected.item())
