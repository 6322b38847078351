"""The step's preference loss is the mean over every pair of the global batch (plus ORPO's NLL per chosen
token of the global batch), however the pairs are split into micro-batches and processes."""

import pytest
import torch
from accelerate import Accelerator
from helpers import micro_llama

from toolkit.preference.config import DpoConfig
from toolkit.preference.data import PairCollator
from toolkit.preference.loss import PairSums, micro_objective, pair_terms, sequence_logps
from toolkit.train.loss import backward_scale

LOSSES = ("sigmoid", "ipo", "simpo", "orpo")
# Prompt and completion lengths that differ wildly, so padding differs between micro-batch splits.
SHAPES = [(3, 2, 9), (7, 11, 1), (2, 5, 5), (9, 1, 3)]


def pairs():
    gen = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(4, 64, (n,), generator=gen).tolist()

    return [
        {"prompt_ids": ids(p), "chosen_ids": ids(c), "rejected_ids": ids(r), "pair_index": i}
        for i, (p, c, r) in enumerate(SHAPES)
    ]


REFERENCE = torch.tensor([-30.0, -41.0, -25.0, -12.0, -28.0, -14.0, -33.0, -20.0], dtype=torch.float64)


def padded_mean_logps(logits, labels):
    """The classic slip: per-token log-probs averaged over the whole padded row."""
    summed, counts = sequence_logps(logits, labels)
    return summed / labels.shape[1], counts


def reference_of(batch):
    """Reference log-probs of a stacked batch, looked up by pair (chosen rows, then rejected rows)."""
    index = batch["pair_index"]
    return torch.cat([REFERENCE[index], REFERENCE[index + 4]])


def step_gradient(loss: str, micro: int, world: int, logps_fn=sequence_logps) -> torch.Tensor:
    """One optimizer step's gradient as the recipe computes it, ranks simulated in this process (DDP
    averages the ranks' gradients)."""
    cfg = DpoConfig(loss=loss, beta=0.5, simpo_gamma=0.3)
    data, collate = pairs(), PairCollator(pad_id=0)
    grad_accum = len(data) // (micro * world)
    shards = [data[rank::world] for rank in range(world)]
    batches = [[collate(shard[i : i + micro]) for i in range(0, len(shard), micro)] for shard in shards]
    chosen_tokens = sum(len(p["chosen_ids"]) for p in data)
    pair_scale = backward_scale(len(data), grad_accum, world)
    token_scale = backward_scale(chosen_tokens, grad_accum, world)
    grads = []
    for rank_batches in batches:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=grad_accum)
        model = accelerator.prepare(micro_llama().double())
        for batch in rank_batches:
            with accelerator.accumulate(model):
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                logps, counts = logps_fn(logits, batch["labels"])
                terms = pair_terms(cfg, logps, counts, reference_of(batch))
                accelerator.backward(micro_objective(terms, pair_scale, token_scale))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return torch.stack(grads).mean(0)


@pytest.mark.parametrize("loss", LOSSES)
def test_one_process_equals_two_processes_with_accumulation(loss):
    reference = step_gradient(loss, micro=4, world=1)
    assert reference.abs().max() > 1e-6
    torch.testing.assert_close(step_gradient(loss, micro=1, world=2), reference, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("loss", LOSSES)
def test_log_probs_averaged_over_padding_are_caught(loss):
    reference = step_gradient(loss, micro=4, world=1, logps_fn=padded_mean_logps)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(
            step_gradient(loss, micro=1, world=2, logps_fn=padded_mean_logps),
            reference,
            rtol=1e-10,
            atol=1e-12,
        )


def test_padding_never_counts():
    model = micro_llama().double()
    row = pairs()[:1]
    narrow = PairCollator(pad_id=0, multiple=1)(row)
    wide = PairCollator(pad_id=0, multiple=32)(row)
    values = []
    for batch in (narrow, wide):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        values.append(sequence_logps(logits, batch["labels"]))
    torch.testing.assert_close(values[0][0], values[1][0], rtol=1e-12, atol=1e-12)
    assert values[0][1].tolist() == [2, 9] == values[1][1].tolist()  # completion tokens, prompt not counted


def test_step_metrics_are_per_pair_means():
    cfg = DpoConfig(loss="sigmoid", beta=1.0)
    logps = torch.tensor([-1.0, -2.0, -3.0, -1.0], dtype=torch.float64)
    terms = pair_terms(cfg, logps, torch.tensor([1, 1, 1, 1]), torch.full((4,), -2.0, dtype=torch.float64))
    sums = PairSums()
    sums.add(terms, logps, torch.tensor([1, 1, 1, 1]))
    metrics = sums.metrics()
    assert metrics["rewards_chosen"] == pytest.approx(0.5) and metrics["rewards_rejected"] == pytest.approx(
        0.0
    )
    assert metrics["reward_accuracy"] == pytest.approx(0.5) and metrics["reward_margin"] == pytest.approx(0.5)
    assert metrics["logps_chosen"] == pytest.approx(-1.5) and metrics["loss"] == pytest.approx(
        terms.losses.mean().item()
    )


def test_pair_sums_leave_out_padding_and_normalise_the_nll_per_chosen_token():
    cfg = DpoConfig(loss="sigmoid", beta=1.0, sft_weight=1.0)
    logps = torch.tensor([-1.0, -4.0, -9.0, -3.0, -1.0, -5.0], dtype=torch.float64)
    counts = torch.tensor([2, 4, 100, 1, 1, 1])
    terms = pair_terms(cfg, logps, counts, torch.full((6,), -2.0, dtype=torch.float64))
    sums = PairSums()
    sums.add(terms, logps, counts, keep=[True, True, False])  # the third pair is a padding copy
    metrics = sums.metrics(prefix="eval_")
    assert list(metrics) == [
        "eval_loss",
        "eval_rewards_chosen",
        "eval_rewards_rejected",
        "eval_reward_accuracy",
        "eval_reward_margin",
        "eval_logps_chosen",
        "eval_logps_rejected",
    ]
    assert metrics["eval_loss"] == pytest.approx(terms.losses[:2].mean().item() + (1.0 + 4.0) / (2 + 4))
    means = {name: metrics[f"eval_{name}"] for name in ("logps_chosen", "logps_rejected", "rewards_chosen")}
    assert means == pytest.approx({"logps_chosen": -2.5, "logps_rejected": -2.0, "rewards_chosen": -0.5})
    assert metrics["eval_rewards_rejected"] == 0 and metrics["eval_reward_margin"] == pytest.approx(-0.5)
    assert metrics["eval_reward_accuracy"] == pytest.approx(0.5)


def test_sft_weight_sets_the_chosen_nll_weight_and_orpo_keeps_its_own_unless_set():
    logps = torch.tensor([-3.0, -5.0, -4.0, -9.0])  # two chosen rows, then two rejected
    counts = torch.tensor([2, 3, 2, 4])
    ref = torch.tensor([-3.5, -5.0, -3.0, -8.0])
    nll = {}
    for loss, weight in [("sigmoid", None), ("sigmoid", 0.5), ("orpo", None), ("orpo", 0.25)]:
        terms = pair_terms(DpoConfig(loss=loss, sft_weight=weight), logps, counts, ref)
        nll[loss, weight] = terms.nll_sum.item()
    assert nll == {("sigmoid", None): 0.0, ("sigmoid", 0.5): 4.0, ("orpo", None): 8.0, ("orpo", 0.25): 2.0}
