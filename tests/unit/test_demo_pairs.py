"""The embedded preference pairs: a correct sum against a wrong one, eval sums held out from training."""

import json
import re
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "toolkit" / "assets" / "demo"


def read(name):
    return [json.loads(line) for line in (DEMO / name).read_text().splitlines()]


def operands(record):
    return tuple(sorted(int(n) for n in re.findall(r"\d+", record["prompt"][-1]["content"])))


def test_pairs_prefer_the_correct_sum_and_hold_out_eval_sums():
    train, held = read("pairs_train.jsonl"), read("pairs_eval.jsonl")
    assert (len(train), len(held)) == (1000, 200)
    for record in train + held:
        a, b = operands(record)
        assert record["chosen"] == str(a + b) and record["rejected"] != record["chosen"]
        assert int(record["rejected"]) >= 0
    assert not {operands(r) for r in train} & {operands(r) for r in held}
    # The same sums the SFT demo holds out.
    sft_eval = {operands({"prompt": [r["messages"][-2]]}) for r in read("eval.jsonl")}
    assert {operands(r) for r in held} == sft_eval
