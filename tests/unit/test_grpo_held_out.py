"""GRPO's held-out evaluation with tools (toolkit/grpo/held_out.py): greedy whole conversations scored on
their final answer, the share that called a tool and the turns they took; single-turn runs keep the first
turn's exact match. A stand-in model writes scripted turns per question; the real generate path runs on the
embedded tiny model; the recipe runs in this process on the scripted agent (tests/scripted_agent.py)."""

from __future__ import annotations

import json

import pytest
import scripted_agent
import torch
from accelerate import Accelerator
from helpers import REPO, load_recipe, short_grpo_args
from test_data import config
from transformers import AutoModelForCausalLM, AutoTokenizer

from toolkit import data
from toolkit.config import EvalConfig
from toolkit.data.chat import ensure_chat_template
from toolkit.errors import run_main
from toolkit.grpo import held_out, multiturn
from toolkit.grpo.config import GrpoConfig, GrpoRecipeConfig
from toolkit.grpo.environment import Environment
from toolkit.grpo.rewards import load_user_function
from toolkit.train.evaluate import Evaluator
from toolkit.train.generation import chat_prompt_ids, greedy_answer
from toolkit.train.metrics import MetricsLog, read_metrics

DEMO = REPO / "toolkit" / "assets" / "demo"
TOOL_TURN = (
    "<|im_end|>\n<|im_start|>tool\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)


def call(expression: str) -> str:
    return (
        f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
    )


class Agent(torch.nn.Module):
    """A stand-in model: `generate` writes, for each row, the next of the turns scripted for the question the
    row's context holds (the k-th turn once the context has k assistant headers after the first)."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        super().__init__()
        self.tokenizer, self.scripts = tokenizer, scripts
        self.device_of = torch.nn.Parameter(
            torch.zeros(1)
        )  # generation puts its inputs on the model's device

    def generate(self, input_ids, attention_mask, **_):
        turns = [
            self._turn(self.tokenizer.decode(row[mask.bool()]))
            for row, mask in zip(input_ids, attention_mask)
        ]
        width = max(map(len, turns))
        pad = self.tokenizer.pad_token_id
        new = torch.tensor([turn + [pad] * (width - len(turn)) for turn in turns])
        return torch.cat([input_ids, new], dim=1)

    def _turn(self, context: str) -> list[int]:
        question = next(q for q in self.scripts if q in context)
        turn = self.scripts[question][context.count("<|im_start|>assistant") - 1]
        return self.tokenizer(turn + "<|im_end|>", add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(REPO / "toolkit" / "assets" / "tiny-llama")
    ensure_chat_template(tok)
    return tok


@pytest.fixture(scope="module")
def held(tokenizer):
    """The demo's first five held-out sums, encoded as the recipe encodes them, and their source rows."""
    path = DEMO / "agent_eval.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()[:5]]
    encoded, _, _ = data.build_datasets(config(str(path), max_length=256), tokenizer, 0)
    return [encoded[i] for i in range(5)], rows


def expression(row: dict) -> str:
    return row["messages"][1]["tool_calls"][0]["function"]["arguments"]["expression"]


def scripted_agent_for(tokenizer, rows) -> Agent:
    """Row 0 calls and answers right; 1 answers wrong at once; 2 calls with a miscopied number and answers
    the tool's (wrong) sum; 3 answers right at once; 4 calls and answers right."""
    q = [row["messages"][0]["content"] for row in rows]
    sums = [row["messages"][-1]["content"] for row in rows]
    first, rest = expression(rows[2]).split(" + ", 1)
    miscopied = f"{int(first) + 1} + {rest}"
    wrong = str(sum(int(n) for n in miscopied.split(" + ")))
    return Agent(
        tokenizer,
        {
            q[0]: [call(expression(rows[0])), sums[0]],
            q[1]: ["5"],
            q[2]: [call(miscopied), wrong],
            q[3]: [sums[3]],
            q[4]: [call(expression(rows[4])), sums[4]],
        },
    )


def calculator_environment() -> Environment:
    return Environment({"calculator": load_user_function(f"{DEMO / 'calculator.py'}:calculator", "tools")}, 5)


def recipe_config(samples: int) -> GrpoRecipeConfig:
    cfg = GrpoRecipeConfig(grpo=GrpoConfig(max_new_tokens=128, max_turns=3))
    cfg.eval.exact_match_samples = samples
    return cfg


def test_conversations_are_scored_on_their_final_answer_with_the_tool_call_share_and_turns(tokenizer, held):
    dataset, rows = held
    model = scripted_agent_for(tokenizer, rows)
    measure = held_out.ConversationEval.build(
        Accelerator(cpu=True), recipe_config(5), tokenizer, dataset, calculator_environment()
    )
    # The references are the rows' last assistant turns (the sums), not their first (the calls).
    assert measure.held_out.answers == [row["messages"][-1]["content"] for row in rows]
    assert measure.measure(model) == {
        "exact_match": 3 / 5,
        "eval_tool_call_share": 3 / 5,
        "eval_turns": 8 / 5,
    }


def test_the_tool_turn_is_the_templates_and_only_the_models_turns_are_marked_its_own(tokenizer, held):
    dataset, rows = held
    cfg = recipe_config(1)
    measure = held_out.ConversationEval.build(
        Accelerator(cpu=True), cfg, tokenizer, dataset, calculator_environment()
    )
    (talk,) = multiturn.greedy_conversations(
        scripted_agent_for(tokenizer, rows),
        tokenizer,
        measure.held_out.ids,
        calculator_environment(),
        cfg.grpo,
        False,
    )
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    first, answer = ids(call(expression(rows[0]))), ids(rows[0]["messages"][-1]["content"] + "<|im_end|>")
    said = talk.tokens[len(first) : len(talk.tokens) - len(answer)]
    assert talk.tokens[: len(first)] == first and talk.tokens[-len(answer) :] == answer
    assert tokenizer.decode(said) == TOOL_TURN.format(rows[0]["messages"][-1]["content"])
    assert talk.trained == [1] * len(first) + [0] * len(said) + [1] * len(answer)
    assert talk.stats == {"turns": 2, "tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0}


def test_the_evaluator_logs_the_conversations_scores_and_single_turn_runs_keep_the_first_turn(
    tokenizer, held, tmp_path
):
    dataset, rows = held
    model = scripted_agent_for(tokenizer, rows)
    accelerator, cfg = Accelerator(cpu=True), recipe_config(5)
    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=True)
    eval_cfg = EvalConfig(exact_match_samples=5, max_new_tokens=96)
    measure = held_out.ConversationEval.build(accelerator, cfg, tokenizer, dataset, calculator_environment())
    Evaluator(accelerator, model, tokenizer, None, dataset, eval_cfg, log, conversations=measure).report(
        0, "before"
    )
    # Without tools (or with no samples asked) nothing changes: the first turn is scored against the first
    # trained turn, the call, which rows 0 and 4 copy right.
    assert held_out.ConversationEval.build(accelerator, cfg, tokenizer, dataset, None) is None
    assert (
        held_out.ConversationEval.build(accelerator, recipe_config(0), tokenizer, dataset, Environment({}, 1))
        is None
    )
    Evaluator(accelerator, model, tokenizer, None, dataset, eval_cfg, log).report(1, "after")
    before, after = read_metrics(log.path)
    assert [before[k] for k in ("step", "exact_match", "eval_tool_call_share", "eval_turns")] == [
        0,
        0.6,
        0.6,
        1.6,
    ]
    assert after["exact_match"] == 2 / 5 and "eval_tool_call_share" not in after


def test_greedy_turns_are_the_models_greedy_answers_whatever_the_batch(tokenizer):
    model = AutoModelForCausalLM.from_pretrained(REPO / "toolkit" / "assets" / "tiny-llama").eval()
    questions = ("What is 12 + 30?", "What is the sum of 25, 90, 88 and 61?", "Add 7 and 5.")
    prompts = [chat_prompt_ids(tokenizer, q) for q in questions]
    grpo = GrpoConfig(max_new_tokens=12, max_turns=1)
    talks = multiturn.greedy_conversations(model, tokenizer, prompts, None, grpo, False)
    alone = [greedy_answer(model, tokenizer, p, 12, synced=False) for p in prompts]
    assert [t.answer for t in talks] == alone
    grpo.generation_batch_size = 1
    again = multiturn.greedy_conversations(model, tokenizer, prompts, None, grpo, False)
    assert [t.tokens for t in again] == [t.tokens for t in talks]


def test_the_recipe_scores_held_out_conversations_before_and_after(tmp_path, capsys):
    """The scripted agent's greedy turn answers "7" at once (its two successors of a turn's start tie, and
    the tie goes to "7"): held out, two of four tool conversations end in "7", none of their calls does."""
    model = scripted_agent.build(tmp_path / "agent")
    rows = [json.loads(line) for line in (DEMO / "tools_eval.jsonl").read_text().splitlines()[:4]]
    for row in rows[::2]:
        row["messages"][-1]["content"] = "7"
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    argv = [
        *short_grpo_args(out, 1, 4, 4),
        f"model.path={model}",
        "model.method=lora",
        f"data.train={DEMO / 'tools_eval.jsonl'}",
        f"data.eval={tmp_path / 'held.jsonl'}",
        "data.max_length=224",
        "eval.exact_match_samples=4",
        "grpo.num_generations=2",
        "grpo.max_new_tokens=64",
        "grpo.max_turns=3",
        "grpo.rewards=[exact_answer]",
        f"grpo.environment.tools=[{DEMO / 'calculator.py'}:calculator]",
    ]
    assert run_main(load_recipe("grpo_llm").main, argv, "grpo_llm") == 0
    before, after = [r for r in read_metrics(out / "metrics.jsonl") if "eval_turns" in r]
    assert (before["step"], after["step"]) == (0, 1)
    assert [before[k] for k in ("exact_match", "eval_tool_call_share", "eval_turns")] == [0.5, 0.0, 1.0]
    assert 0 <= after["exact_match"] <= 1 and 0 <= after["eval_tool_call_share"] <= 1
    assert 1 <= after["eval_turns"] <= 3
    assert "result: held-out exact match 50.0% -> " in capsys.readouterr().out
