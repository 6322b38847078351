"""Reward models: the Bradley-Terry loss (with margins and reward centering) equals TRL's RewardTrainer's
on the same model and batch (TRL is a dev-only dependency), the pairs' margin column, and the recipe's
config checks."""

import json
import os
from pathlib import Path

import datasets
import pytest
import torch
from helpers import trl_sized_llama
from transformers import AutoTokenizer, LlamaForSequenceClassification

from toolkit.config import DataConfig
from toolkit.errors import UserError
from toolkit.model import scalar
from toolkit.preference.data import PairCollator, build_pairs
from toolkit.recipes import load_recipe_config, recipe_of
from toolkit.reward.config import RewardConfig
from toolkit.reward.loss import RewardSums, batch_rewards, reward_terms

trl = pytest.importorskip("trl")
TINY = Path(__file__).resolve().parents[2] / "toolkit" / "assets" / "tiny-llama"
REPO = TINY.parents[2]
PAIRS = [
    {"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "16", "margin": 1.5},
    {"prompt": "What is 40 plus 7? Answer briefly.", "chosen": "47", "rejected": "It is 48, I think"},
    {"prompt": "Add 9 and 9.", "chosen": "18", "rejected": "81", "margin": 0.25},
]


def write_pairs(path: Path, pairs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    return path


@pytest.fixture
def setup(tmp_path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    torch.manual_seed(0)
    config = trl_sized_llama(tokenizer, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForSequenceClassification(config).eval()
    with torch.no_grad():  # scores far from zero, so the centering term is not negligible
        model.score.weight.mul_(50)
    path = write_pairs(tmp_path / "pairs.jsonl", PAIRS)
    train, _, _ = build_pairs(DataConfig(train=str(path), eval_fraction=0), tokenizer, 32, seed=0)
    return tokenizer, model, [train[i] for i in range(len(train))]


@pytest.mark.parametrize(("margins", "center"), [(False, 0.0), (True, 0.0), (True, 0.05)])
def test_bradley_terry_matches_trl(setup, tmp_path, margins, center):
    tokenizer, model, rows = setup
    if not margins:
        rows = [{**row, "margin": 0.0} for row in rows]
    args = trl.RewardConfig(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, center_rewards_coefficient=center or None
    )
    dataset = datasets.Dataset.from_list([{k: v for k, v in p.items() if k != "margin"} for p in PAIRS])
    trainer = trl.RewardTrainer(model, args=args, train_dataset=dataset, processing_class=tokenizer)
    batch = PairCollator(tokenizer.pad_token_id)(rows)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if margins:
        inputs["margin"] = batch["margin"]
    with torch.no_grad():
        theirs = trainer.compute_loss(trainer.model, dict(inputs)).item()
        terms = reward_terms(
            RewardConfig(center_coefficient=center), batch_rewards(model, batch), batch["margin"]
        )
    assert terms.losses.mean().item() == pytest.approx(theirs, rel=1e-5, abs=1e-5)
    assert (terms.chosen - terms.rejected).abs().max() > 1e-2  # not a comparison of ties
    if margins:
        assert batch["margin"].tolist() == [1.5, 0.0, 0.25]
    sums = RewardSums()
    sums.add(terms)
    logged = trainer._metrics["eval"]
    assert sums.metrics()["reward_margin"] == pytest.approx(logged["margin"][-1], rel=1e-5)
    assert sums.metrics()["reward_accuracy"] == pytest.approx(logged["accuracy"][-1])


def test_pairs_read_their_margin_or_refuse_a_bad_one(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    bad = write_pairs(tmp_path / "bad.jsonl", [{**PAIRS[0], "margin": "high"}])
    with pytest.raises(UserError, match=r"bad.jsonl:1: 'margin' must be a number, got 'high'"):
        build_pairs(DataConfig(train=str(bad), eval_fraction=0), tokenizer, 32, seed=0)
    same = write_pairs(tmp_path / "same.jsonl", [{"prompt": "2 + 2?", "chosen": "4", "rejected": "4"}])
    with pytest.raises(UserError, match="'chosen' is identical to 'rejected'"):
        build_pairs(DataConfig(train=str(same), eval_fraction=0), tokenizer, 32, seed=0)


def test_reward_configs_are_told_apart_and_checked():
    from toolkit.commands.train import recipe_path, split_items

    demo = REPO / "recipes" / "configs" / "demo-rm.yaml"
    assert recipe_of(demo) == "rm"
    assert split_items(["rm", "a=1"], None) == ("rm", ["a=1"]) and split_items([], str(demo))[0] == "rm"
    assert recipe_path("rm") == REPO / "recipes" / "reward_llm.py"
    assert (REPO / "toolkit" / "assets" / "demo-rm.yaml").read_bytes() == demo.read_bytes()
    assert load_recipe_config("rm", REPO / "bench" / "ftkit-rm.yaml", []).reward.center_coefficient == 0
    cfg = load_recipe_config("rm", demo, ["reward.center_coefficient=0.5"])
    assert cfg.reward.center_coefficient == 0.5
    for override, words in [
        ("data.packing=true", "data.packing is for SFT"),
        ("data.streaming=true", "data.streaming is for SFT"),
        ("loss.head=chunked", "loss.head: chunked"),
        ("reward.max_prompt_length=64", "reward.max_prompt_length: must be below"),
        ("reward.center_coefficent=1", "center_coefficient"),
    ]:
        with pytest.raises(UserError, match=words):
            load_recipe_config("rm", demo, [override])


def test_scalar_folders_are_recognised(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"]}))
    assert scalar.saved_scalar(tmp_path)
    assert not scalar.saved_scalar(TINY)


@pytest.fixture
def reward_folder(tmp_path):
    """A reward model folder as recipes/reward_llm.py exports one: the embedded model with a scalar head."""
    torch.manual_seed(0)
    folder = tmp_path / "rm"
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    model = LlamaForSequenceClassification.from_pretrained(TINY, num_labels=1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, tokenizer


def test_a_reward_model_is_a_grpo_reward(reward_folder, tmp_path):
    from toolkit.grpo.config import GrpoConfig, GrpoRecipeConfig, validate_grpo
    from toolkit.grpo.rewards import Rewards
    from toolkit.reward.score import answer_ids, score_rows

    folder, tokenizer = reward_folder
    rewards = Rewards.build(GrpoConfig(rewards=[str(folder), "exact_answer"], reward_weights=[0.5, 1.0]))
    rewards.check_tokenizer(tokenizer)
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    rows = [answer_ids(tokenizer, prompt, answer, "test") for answer in ("5", "23")]
    scores = rewards.score(["q", "q"], ["5", "23"], ["5", "5"], [2, 3], rows)
    model = LlamaForSequenceClassification.from_pretrained(folder)
    expected = score_rows(model, rows, tokenizer.pad_token_id)
    assert scores["model"] == pytest.approx(expected, abs=1e-5)
    assert scores["total"] == pytest.approx([0.5 * expected[0] + 1.0, 0.5 * expected[1]], abs=1e-5)
    other = AutoTokenizer.from_pretrained(TINY)
    other.add_tokens(["<extra>"])
    with pytest.raises(UserError, match=r"grpo.rewards: .*rm: the reward model's tokenizer differs"):
        rewards.check_tokenizer(other)
    not_rm = GrpoRecipeConfig(grpo=GrpoConfig(rewards=[str(TINY)]))
    with pytest.raises(UserError, match="is a folder but not a reward model"):
        validate_grpo(not_rm)
