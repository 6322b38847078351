"""ftkit's preference losses equal TRL's trainers' on identical weights and batches (TRL is a dev-only
dependency). TRL is driven through its trainers' public loss methods: DPOTrainer.compute_loss for sigmoid
and ipo, CPOTrainer (loss_type simpo, cpo_alpha 0) and ORPOTrainer .get_batch_loss_metrics for the
reference-free losses, DPOTrainer with loss types sigmoid + sft for dpo.sft_weight; its logged rewards
are compared pair by pair (batches of one pair)."""

import json
import os
from pathlib import Path

import datasets
import pytest
import torch
from helpers import policy_and_reference, trl_sized_llama
from transformers import AutoTokenizer

from toolkit.config import DataConfig
from toolkit.preference.config import DpoConfig
from toolkit.preference.data import PairCollator, build_pairs
from toolkit.preference.loss import pair_terms, sequence_logps
from toolkit.train.loss import IGNORE

trl = pytest.importorskip("trl")
cpo = pytest.importorskip("trl.experimental.cpo")
orpo = pytest.importorskip("trl.experimental.orpo")
TINY = Path(__file__).resolve().parents[2] / "toolkit" / "assets" / "tiny-llama"
# Within 1e-5: rewards are beta x a difference of two float32 sums of ~20, whose rounding alone is ~1e-6.
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
PAIRS = [
    {"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "16"},
    {"prompt": "What is 40 plus 7? Answer briefly.", "chosen": "47", "rejected": "It is 48, I think"},
    {"prompt": "Add 9 and 9.", "chosen": "18", "rejected": "81"},
]


@pytest.fixture
def setup(tmp_path):
    """Fresh models per test: a TRL trainer patches the models it is given."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    policy, reference = policy_and_reference(trl_sized_llama(tokenizer))
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(pair) + "\n" for pair in PAIRS))
    train, _, _ = build_pairs(DataConfig(train=str(path), eval_fraction=0), tokenizer, 32, seed=0)
    rows = [train[i] for i in range(len(train))]
    return tokenizer, policy, reference, rows


def trl_args(output_dir):
    return dict(output_dir=str(output_dir), report_to=[], use_cpu=True, per_device_train_batch_size=1)


def ours(cfg, policy, reference, batch):
    with torch.no_grad():
        logps, counts = sequence_logps(policy(**_model_inputs(batch)).logits, batch["labels"])
        ref = sequence_logps(reference(**_model_inputs(batch)).logits, batch["labels"])[0]
    terms = pair_terms(cfg, logps, counts, ref)
    chosen_tokens = counts.chunk(2)[0].sum()
    return terms, (terms.losses.mean() + terms.nll_sum / chosen_tokens).item()


def _model_inputs(batch):
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def _dataset():
    return datasets.Dataset.from_list(PAIRS)


@pytest.mark.parametrize(("loss", "sft_weight"), [("sigmoid", 0.0), ("ipo", 0.0), ("sigmoid", 0.7)])
def test_dpo_and_ipo_match_trl(setup, tmp_path, loss, sft_weight):
    tokenizer, policy, reference, rows = setup
    cfg = DpoConfig(loss=loss, beta=0.3, sft_weight=sft_weight)
    # dpo.sft_weight is TRL's DPO combined with its "sft" loss (mean NLL of the chosen tokens).
    types, weights = ([loss, "sft"], [1.0, sft_weight]) if sft_weight else ([loss], None)
    trainer = trl.DPOTrainer(
        policy,
        ref_model=reference,
        args=trl.DPOConfig(loss_type=types, loss_weights=weights, beta=cfg.beta, **trl_args(tmp_path)),
        train_dataset=_dataset(),
        processing_class=tokenizer,
    )
    collate = PairCollator(tokenizer.pad_token_id)

    def trl_values(batch):
        inputs = {**_model_inputs(batch), "completion_mask": (batch["labels"] != IGNORE).long()}
        with torch.no_grad():
            value = trainer.compute_loss(trainer.model, inputs).item()
        logged = trainer._metrics["train" if trainer.model.training else "eval"]
        return value, logged["rewards/chosen"][-1], logged["rewards/rejected"][-1]

    batch = collate(rows)
    terms, value = ours(cfg, policy, reference, batch)
    assert value == pytest.approx(trl_values(batch)[0], rel=1e-5)
    assert terms.chosen_rewards.abs().max() > 1e-3  # the comparison below is not between zeros
    for row in rows:
        one, _ = ours(cfg, policy, reference, collate([row]))
        _, theirs_chosen, theirs_rejected = trl_values(collate([row]))
        torch.testing.assert_close(one.chosen_rewards.item(), theirs_chosen, **TOLERANCE)
        torch.testing.assert_close(one.rejected_rewards.item(), theirs_rejected, **TOLERANCE)


def trl_pair_batch(batch):
    """TRL's CPO/ORPO batch layout from our stacked one."""
    halves = {key: value.chunk(2) for key, value in batch.items() if key != "pair_index"}
    out = {}
    for side, index in (("chosen", 0), ("rejected", 1)):
        out[f"{side}_input_ids"] = halves["input_ids"][index]
        out[f"{side}_attention_mask"] = halves["attention_mask"][index]
        out[f"{side}_labels"] = halves["labels"][index]
    return out


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_reference_free_losses_match_trl(setup, tmp_path, loss):
    tokenizer, policy, reference, rows = setup
    cfg = DpoConfig(loss=loss, beta=2.0 if loss == "simpo" else 0.2, simpo_gamma=0.7)
    if loss == "simpo":
        args = cpo.CPOConfig(
            loss_type="simpo", cpo_alpha=0.0, beta=cfg.beta, simpo_gamma=cfg.simpo_gamma, **trl_args(tmp_path)
        )
        trainer_class = cpo.CPOTrainer
    else:
        # TRL's ORPO takes its NLL over the whole chosen sequence; with one-token prompts (never predicted)
        # that is exactly the chosen completion, where ftkit takes it.
        rows = [{**row, "prompt_ids": row["prompt_ids"][:1]} for row in rows]
        args = orpo.ORPOConfig(beta=cfg.beta, **trl_args(tmp_path))
        trainer_class = orpo.ORPOTrainer
    trainer = trainer_class(policy, args=args, train_dataset=_dataset(), processing_class=tokenizer)
    collate = PairCollator(tokenizer.pad_token_id)
    batch = collate(rows)
    terms, value = ours(cfg, policy, reference, batch)
    with torch.no_grad():
        theirs, _ = trainer.get_batch_loss_metrics(policy, trl_pair_batch(batch))
    assert value == pytest.approx(theirs.item(), rel=1e-5)
    assert terms.chosen_rewards.abs().max() > 1e-3
    for row in rows:
        one, _ = ours(cfg, policy, reference, collate([row]))
        with torch.no_grad():
            _, metrics = trainer.get_batch_loss_metrics(policy, trl_pair_batch(collate([row])))
        torch.testing.assert_close(one.chosen_rewards.item(), metrics["rewards/chosen"], **TOLERANCE)
        torch.testing.assert_close(one.rejected_rewards.item(), metrics["rewards/rejected"], **TOLERANCE)
