"""`ftkit sample-pairs`: reward-model pairs of a reference answer against the policy's own wrong samples,
drawn with GRPO's seeded sampling, written in a layout the reward recipe reads."""

import json
import os
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from toolkit.commands import cli
from toolkit.config import DataConfig
from toolkit.errors import UserError
from toolkit.grpo.config import GrpoConfig
from toolkit.grpo.sampling import completion_seed, sample
from toolkit.preference.data import build_pairs, render_answer
from toolkit.reward.policy_pairs import read_prompts, sample_pairs, wrong_answers

TINY = Path(__file__).resolve().parents[2] / "toolkit" / "assets" / "tiny-llama"
ROWS = [
    {"messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]},
    {"prompt": "Add 9 and 9.", "completion": "18"},
]


@pytest.fixture(scope="module")
def policy():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return AutoModelForCausalLM.from_pretrained(TINY).eval(), AutoTokenizer.from_pretrained(TINY)


@pytest.fixture
def sft_file(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


def test_wrong_answers_are_distinct_stripped_and_never_the_reference():
    samples = [" 5", "6", "6 ", "", "  ", "7", "5", "60"]
    assert wrong_answers("5", samples) == ["6", "7", "60"]
    assert wrong_answers("5", ["5", " 5 "]) == []


def test_read_prompts_splits_every_sft_layout(sft_file, tmp_path):
    prompts = read_prompts(str(sft_file))
    assert [(turns, answer) for turns, answer, _ in prompts] == [
        ([{"role": "user", "content": "What is 2 + 3?"}], "5"),
        ([{"role": "user", "content": "Add 9 and 9."}], "18"),
    ]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "q", "chosen": "1", "rejected": "2"}) + "\n")
    with pytest.raises(UserError, match="preference pairs"):
        read_prompts(str(pairs))


def test_pairs_are_the_wrong_samples_grpo_would_draw(policy, sft_file):
    model, tokenizer = policy
    prompts = read_prompts(str(sft_file))
    records = sample_pairs(model, tokenizer, prompts, 4, 1.0, 3, seed=7)
    settings = GrpoConfig(num_generations=4, temperature=1.0, max_new_tokens=3)
    expected = []
    for index, (turns, answer, where) in enumerate(prompts):
        text, _ = render_answer(tokenizer, turns, [{"role": "assistant", "content": answer}], where)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        seeds = [completion_seed(7, 0, index, index, g) for g in range(4)]
        drawn = sample(
            model, [ids] * 4, seeds, settings, tokenizer.pad_token_id, tokenizer.eos_token_id, False
        )
        texts = tokenizer.batch_decode(drawn, skip_special_tokens=True)
        expected += [
            {"prompt": turns, "chosen": answer, "rejected": wrong} for wrong in wrong_answers(answer, texts)
        ]
    assert records == expected and len(records) >= 2
    assert sample_pairs(model, tokenizer, prompts, 4, 1.0, 3, seed=7) == records
    assert sample_pairs(model, tokenizer, prompts, 4, 1.0, 3, seed=8) != records


def test_the_command_writes_pairs_the_reward_recipe_reads(policy, sft_file, tmp_path, capsys):
    _, tokenizer = policy
    out = tmp_path / "runs" / "pairs.jsonl"
    args = ["--data", str(sft_file), "--out", str(out), "--samples", "3", "--max-new-tokens", "2"]
    assert cli.main(["sample-pairs", "--model", str(TINY), *args]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert capsys.readouterr().out.startswith(f"{len(records)} pairs from 2 of 2 prompts")
    assert {record["chosen"] for record in records} == {"5", "18"}
    train, _, _ = build_pairs(DataConfig(train=str(out), eval_fraction=0), tokenizer, 32, seed=0)
    assert len(train) == len(records)
    assert cli.main(["sample-pairs", "--model", str(TINY), *args, "--samples", "0"]) == 2
    # An existing file is never replaced: one line naming it, exit 2, the file as it was.
    before = out.read_text()
    assert cli.main(["sample-pairs", "--model", str(TINY), *args]) == 2
    assert f"{out}: already exists" in capsys.readouterr().err
    assert out.read_text() == before and sorted(p.name for p in out.parent.iterdir()) == ["pairs.jsonl"]
