"""KTO: its loss equals TRL's KTOTrainer's on identical weights and batches (TRL is a dev-only dependency),
rows read from the unpaired layout or split out of pairs, each with a mismatched completion for the KL
estimate, and the one-line refusals (a row without its flag, rows of one kind, unpaired rows given to DPO)."""

import json
import os
from pathlib import Path

import datasets
import pytest
import torch
from helpers import policy_and_reference, trl_sized_llama
from transformers import AutoTokenizer

from toolkit.config import DataConfig
from toolkit.errors import UserError
from toolkit.preference.config import DpoConfig, KtoConfig, PreferenceConfig
from toolkit.preference.data import PairCollator, build_pairs
from toolkit.preference.kto import KtoSums, kto_terms
from toolkit.preference.loss import sequence_logps
from toolkit.preference.unpaired import build_rows
from toolkit.train.loss import IGNORE

trl = pytest.importorskip("trl")
TINY = Path(__file__).resolve().parents[2] / "toolkit" / "assets" / "tiny-llama"
ROWS = [
    {"prompt": "What is 2 + 3?", "completion": "5", "label": True},
    {"prompt": "What is 40 plus 7? Answer briefly.", "completion": "It is 48, I think", "label": False},
    {"prompt": "Add 9 and 9.", "completion": "18", "label": True},
    {"prompt": "Add 6 and 7.", "completion": "67", "label": False},
]


def write(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


@pytest.fixture
def setup(tmp_path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    policy, reference = policy_and_reference(trl_sized_llama(tokenizer))
    train, _, _ = build_rows(
        DataConfig(train=write(tmp_path / "rows.jsonl", ROWS), eval_fraction=0), tokenizer, 32, 0
    )
    return tokenizer, policy, reference, [train[i] for i in range(len(train))]


def trl_batch(batch):
    """TRL's KTO batch from our stacked one: the rows, then their mismatched (KL) rows."""
    (ids, kl_ids), (mask, kl_mask), (labels, kl_labels) = (
        batch[key].chunk(2) for key in ("input_ids", "attention_mask", "labels")
    )
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "completion_mask": (labels != IGNORE).long(),
        "KL_input_ids": kl_ids,
        "KL_attention_mask": kl_mask,
        "KL_completion_mask": (kl_labels != IGNORE).long(),
        "label": batch["label"],
    }


@pytest.mark.parametrize(("desirable", "undesirable"), [(1.0, 1.0), (1.33, 0.5)])
def test_kto_matches_trl(setup, tmp_path, desirable, undesirable):
    tokenizer, policy, reference, rows = setup
    cfg = PreferenceConfig(dpo=DpoConfig(loss="kto", beta=0.3), kto=KtoConfig(desirable, undesirable))
    args = trl.KTOConfig(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=2,
        beta=cfg.dpo.beta,
        desirable_weight=desirable,
        undesirable_weight=undesirable,
    )
    trainer = trl.KTOTrainer(
        policy,
        ref_model=reference,
        args=args,
        train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=tokenizer,
    )
    batch = PairCollator(tokenizer.pad_token_id)(rows)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        logps = sequence_logps(policy(**inputs).logits, batch["labels"])[0]
        ref = sequence_logps(reference(**inputs).logits, batch["labels"])[0]
        theirs = trainer.compute_loss(trainer.model, trl_batch(batch)).item()
    (own, mismatched), (ref_own, ref_mismatched) = logps.chunk(2), ref.chunk(2)
    kl = (mismatched - ref_mismatched).mean().clamp(min=0)
    terms = kto_terms(cfg, own, ref_own, batch["label"], kl)
    assert terms.losses.mean().item() == pytest.approx(theirs, rel=1e-5, abs=1e-5)
    logged = trainer._metrics["eval"]
    assert kl.item() == pytest.approx(logged["kl"][-1], rel=1e-5, abs=1e-6)
    assert kl.item() > 0  # the KL term takes part, not clamped away
    # Rewards are beta x a difference of two float32 sums of ~20, whose rounding alone is ~1e-6.
    sums = KtoSums(None, kl)
    sums.add(terms, own)
    metrics = sums.metrics()
    assert metrics["rewards_chosen"] == pytest.approx(logged["rewards/chosen"][-1], rel=1e-5, abs=1e-5)
    assert metrics["rewards_rejected"] == pytest.approx(logged["rewards/rejected"][-1], rel=1e-5, abs=1e-5)


def test_pairs_split_into_both_kinds_each_with_a_mismatched_completion(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    pairs = [{"prompt": f"What is {i} + 1?", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(6)]
    data = DataConfig(train=write(tmp_path / "pairs.jsonl", pairs), eval_fraction=0)
    rows, _, stats = build_rows(data, tokenizer, 32, seed=0)
    assert len(rows) == 12 and sum(rows["label"]) == 6
    assert "12 train rows" in stats.summary()
    own = {tuple(ids) for ids in rows["chosen_ids"]}
    assert all(tuple(ids) in own for ids in rows["rejected_ids"])  # another row's completion
    assert sum(a == b for a, b in zip(rows["chosen_ids"], rows["rejected_ids"])) < len(rows)
    again, _, _ = build_rows(data, tokenizer, 32, seed=0)
    assert again["rejected_ids"] == rows["rejected_ids"]  # the seed's, so every process and resume agree


@pytest.mark.parametrize(
    ("records", "words"),
    [
        ([{"prompt": "2 + 2?", "completion": "4"}], r"rows.jsonl:1: missing 'label'"),
        ([{"prompt": "2 + 2?", "completion": "4", "label": "yes"}], r"'label' must be true .* got 'yes'"),
        ([{**r, "label": True} for r in ROWS], "data.train: all 4 rows are desirable"),
        ([{"prompt": "2 + 2?", "chosen": "4", "rejected": "4"}], "'chosen' is identical to 'rejected'"),
    ],
)
def test_bad_rows_are_one_line(tmp_path, records, words):
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    data = DataConfig(train=write(tmp_path / "rows.jsonl", records), eval_fraction=0)
    with pytest.raises(UserError, match=words):
        build_rows(data, tokenizer, 32, seed=0)


def test_unpaired_rows_given_to_dpo_name_kto(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    data = DataConfig(train=write(tmp_path / "rows.jsonl", ROWS), eval_fraction=0)
    with pytest.raises(UserError, match=r"rows.jsonl:1: .* not a pair.*dpo.loss: kto"):
        build_pairs(data, tokenizer, 32, seed=0)
