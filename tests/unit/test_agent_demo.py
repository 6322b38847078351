"""The agent demo's data (scripts/build_agent_data.py) and its held-out measure
(scripts/measure_agent_demo.py): the shipped files are the script's, the held-out sums are never trained
on, and a scripted model's conversation with the calculator is scored on its final answer."""

import importlib.util
import json
import re
import subprocess

import torch
from helpers import REPO
from transformers import AutoTokenizer

from toolkit.grpo.environment import Environment
from toolkit.grpo.rewards import load_user_function

DEMO = REPO / "toolkit" / "assets" / "demo"
FILES = ("agent_train.jsonl", "agent_direct_train.jsonl", "agent_eval.jsonl", "agent_no_call_train.jsonl")


def script(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(name):
    return [json.loads(line) for line in (DEMO / name).read_text().splitlines()]


def numbers(row):
    return tuple(sorted(int(n) for n in re.findall(r"\d+", row["messages"][0]["content"])))


def calculator():
    return load_user_function(str(DEMO / "calculator.py") + ":calculator", "calculator")


def test_the_shipped_agent_data_is_what_its_script_writes(tmp_path):
    script("build_agent_data").main(tmp_path)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (DEMO / name).read_bytes(), name


def test_agent_sums_are_too_long_for_the_head_and_held_out():
    train, direct, held, no_call = (rows(name) for name in FILES)
    assert (len(train), len(direct), len(held), len(no_call)) == (1000, 500, 200, 1500)
    trained = [numbers(row) for row in train + direct + no_call]
    assert len(set(trained)) == len(trained), "no sum is trained twice, in any order"
    assert {numbers(row) for row in held}.isdisjoint(trained)
    everything = train + direct + held + no_call
    assert all(len(numbers(row)) in (3, 4) and min(numbers(row)) >= 10 for row in everything)
    for row in train + held:
        call = row["messages"][1]["tool_calls"][0]["function"]
        assert (
            calculator()(**call["arguments"])
            == row["messages"][2]["content"]
            == row["messages"][3]["content"]
        )
        assert row["tools"][0]["function"]["name"] == "calculator"
    assert all("tools" not in row and len(row["messages"]) == 2 for row in direct)
    for row in no_call:  # the tool listed, the sum answered without calling it
        assert row["tools"] == train[0]["tools"] and len(row["messages"]) == 2
        assert row["messages"][1]["content"] == str(sum(numbers(row)))


class Scripted(torch.nn.Module):
    """Stands in for a model: each generate call appends the next scripted turn to every row."""

    def __init__(self, tokenizer, turns):
        super().__init__()
        self.turns = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in turns]
        self.contexts = []
        self.device_of = torch.nn.Parameter(
            torch.zeros(1)
        )  # generation puts its inputs on the model's device

    def generate(self, input_ids, attention_mask, **_):
        self.contexts.append(input_ids)
        turn = torch.tensor(self.turns[len(self.contexts) - 1]).expand(len(input_ids), -1)
        return torch.cat([input_ids, turn], dim=1)


def test_a_conversation_is_scored_on_the_answer_after_the_tool_result():
    measure = script("measure_agent_demo")
    tokenizer = AutoTokenizer.from_pretrained(REPO / "toolkit" / "assets" / "tiny-llama")
    row = rows("agent_eval.jsonl")[0]
    expression = row["messages"][1]["tool_calls"][0]["function"]["arguments"]["expression"]
    call = (
        f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
    )
    answer = row["messages"][-1]["content"]
    model = Scripted(tokenizer, [call + "<|im_end|>", answer + "<|im_end|>"])
    environment = Environment({"calculator": calculator()}, timeout_s=5)
    answers, calls = measure.converse(model, tokenizer, [row], environment, max_turns=3, max_new_tokens=128)
    assert (answers, calls) == ([answer], [1])
    # The second turn read the calculator's result, written as the template writes a tool turn.
    assert f"<tool_response>\n{answer}\n</tool_response>" in tokenizer.decode(model.contexts[1][0])
    # Without a call, the first turn is the answer: a wrong sum scores nothing.
    model = Scripted(tokenizer, ["7<|im_end|>"])
    assert measure.converse(model, tokenizer, [row], environment, 3, 128) == (["7"], [0])


def test_the_cpu_matrix_measures_each_cells_own_run_and_reads_its_result_line():
    """scripts/demo_matrix.py runs `make demo-agent ARGS="seed=S output_dir=CELL"` and reads the last
    `result:` line: the measure must score CELL's model, not runs/demo-agent's, and end with that line."""

    def measured(*args):
        plan = subprocess.run(["make", "-n", "demo-agent", *args], cwd=REPO, capture_output=True, text=True)
        return [line.split()[-2:] for line in plan.stdout.splitlines() if "measure_agent_demo.py" in line]

    start = "runs/demo-agent-start/final"
    assert measured() == [[start, "runs/demo-agent/final"]]
    assert measured("ARGS=seed=1 output_dir=runs/matrix/cell") == [[start, "runs/matrix/cell/final"]]
    line = script("measure_agent_demo").result_line([4.5, 39.0, 56.5])
    assert script("demo_matrix").RESULT.findall(line) == [("4.5", "56.5")]
