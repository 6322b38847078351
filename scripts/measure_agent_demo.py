"""Held-out exact match of the agent demo (toolkit/assets/demo/agent_eval.jsonl) for model directories:
greedy conversations with the calculator tool, as GRPO's held-out evaluation runs them
(toolkit/grpo/held_out.py: the model's turn ends at its end-of-turn token or its tool call's close; its
calls run and their results follow in the template's own form; up to --max-turns model turns within
--max-new-tokens for the whole conversation), and the same questions asked with no tool listed.

    python scripts/measure_agent_demo.py runs/demo-agent-start/final runs/demo-agent/final

The final answer is the conversation's last model turn; it counts when it equals the reference sum. With
two or more folders it ends with a `result:` line, the first folder's exact match with the calculator ->
the last's (the line scripts/demo_matrix.py reads).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from toolkit.errors import run_main
from toolkit.grpo.config import GrpoConfig
from toolkit.grpo.environment import Environment
from toolkit.grpo.multiturn import greedy_conversations
from toolkit.grpo.rewards import load_user_function
from toolkit.model.for_generation import load_for_generation

REPO = Path(__file__).resolve().parent.parent
CALCULATOR = "toolkit/assets/demo/calculator.py:calculator"


def prompt_ids(tokenizer, row: dict, with_tools: bool) -> list[int]:
    """The row's question, with its tools listed or not, ready for the model's first turn."""
    tools = row.get("tools") if with_tools else None
    text = tokenizer.apply_chat_template(
        row["messages"][:1], tools=tools, tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def converse(model, tokenizer, rows, environment, max_turns: int, max_new_tokens: int, batch: int = 50):
    """(final answers, number of tool calls) of each row's greedy conversation with the tools: the
    recipe's held-out evaluation (toolkit/grpo/multiturn.py's greedy_conversations)."""
    contexts = [prompt_ids(tokenizer, row, True) for row in rows]
    limits = GrpoConfig(max_turns=max_turns, max_new_tokens=max_new_tokens, generation_batch_size=batch)
    talks = greedy_conversations(model, tokenizer, contexts, environment, limits, synced=False)
    return [talk.answer for talk in talks], [talk.stats["tool_calls"] for talk in talks]


def direct(model, tokenizer, rows, max_new_tokens: int, batch: int = 50) -> list[str]:
    """Each row's question answered with no tool listed, in one turn."""
    contexts = [prompt_ids(tokenizer, row, False) for row in rows]
    limits = GrpoConfig(max_turns=1, max_new_tokens=max_new_tokens, generation_batch_size=batch)
    return [talk.answer for talk in greedy_conversations(model, tokenizer, contexts, None, limits, False)]


def measure(path: Path, rows, environment, max_turns: int, max_new_tokens: int) -> dict:
    model, tokenizer = load_for_generation(path)
    references = [row["messages"][-1]["content"] for row in rows]
    answers, calls = converse(model, tokenizer, rows, environment, max_turns, max_new_tokens)
    plain = direct(model, tokenizer, rows, max_new_tokens)
    hits = sum(a == r for a, r in zip(answers, references, strict=True))
    return {
        "model": str(path),
        "exact_match_with_tool": hits / len(rows),
        "calls_tool": sum(c > 0 for c in calls) / len(rows),
        "exact_match_without_tool": sum(a == r for a, r in zip(plain, references, strict=True)) / len(rows),
    }


def result_line(scores: list[float]) -> str:
    """The first folder's exact match with the calculator -> the last's, in percent."""
    return f"result: held-out exact match with the calculator {scores[0]:.1f}% -> {scores[-1]:.1f}%"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path, help="model directories (final/, merged/, ...)")
    parser.add_argument("--data", type=Path, default=REPO / "toolkit/assets/demo/agent_eval.jsonl")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument(
        "--max-new-tokens", type=int, default=128, help="per conversation, as grpo.max_new_tokens"
    )
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = [json.loads(line) for line in args.data.read_text().splitlines()]
    calculator = load_user_function(str(REPO / CALCULATOR), "calculator")
    environment = Environment({"calculator": calculator}, timeout_s=5)
    scores = []
    for path in args.models:
        result = measure(path, rows, environment, args.max_turns, args.max_new_tokens)
        print(json.dumps(result), flush=True)
        scores.append(100 * result["exact_match_with_tool"])
    if len(scores) > 1:
        print(result_line(scores))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, sys.argv[1:], "measure_agent_demo"))  # a wrong folder: one line, exit 2
