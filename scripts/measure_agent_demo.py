"""Held-out exact match of the agent demo (toolkit/assets/demo/agent_eval.jsonl) for model directories:
greedy conversations with the calculator tool, as GRPO's environment runs them (the model's turn ends at its
end-of-turn token; its calls run and their results follow in the template's own form; up to --max-turns
model turns), and the same questions asked with no tool listed, answered directly.

    python scripts/measure_agent_demo.py runs/demo-agent-start/final runs/demo-agent/final

The final answer is the conversation's last model turn; it counts when it equals the reference sum.
"""

import argparse
import json
from pathlib import Path

import torch

from toolkit.commands.generate import load_for_generation
from toolkit.grpo.environment import Environment, parse_calls
from toolkit.grpo.multiturn import environment_turns
from toolkit.grpo.rewards import load_user_function

REPO = Path(__file__).resolve().parent.parent
CALCULATOR = "toolkit/assets/demo/calculator.py:calculator"


def prompt_ids(tokenizer, row: dict, with_tools: bool) -> list[int]:
    """The row's question, with its tools listed or not, ready for the model's first turn."""
    tools = row.get("tools") if with_tools else None
    text = tokenizer.apply_chat_template(
        row["messages"][:1], tools=tools, tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def greedy_turns(model, tokenizer, contexts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Each context's greedy next turn (left-padded batch), through its end-of-turn token."""
    width = max(map(len, contexts))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(c)) + c for c in contexts])
    mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id,
    )
    turns = []
    for row in out[:, width:].tolist():
        end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        turns.append(row[:end])
    return turns


def converse(model, tokenizer, rows, environment, max_turns: int, max_new_tokens: int, batch: int = 50):
    """(final answers, number of tool calls) of each row's greedy conversation with the tools."""
    contexts = [prompt_ids(tokenizer, row, True) for row in rows]
    answers, calls = [""] * len(rows), [0] * len(rows)
    active = list(range(len(rows)))
    for turn in range(max_turns):
        sampled = []
        for start in range(0, len(active), batch):
            part = [contexts[i] for i in active[start : start + batch]]
            sampled += greedy_turns(model, tokenizer, part, max_new_tokens)
        still = []
        for i, tokens in zip(active, sampled, strict=True):
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            answers[i], found = text.strip(), parse_calls(text)
            calls[i] += len(found)
            if found and tokens[-1] == tokenizer.eos_token_id and turn + 1 < max_turns:
                results = [environment.run(call) for call in found]
                contexts[i] = contexts[i] + tokens
                contexts[i] += environment_turns(tokenizer, text, found, results, environment.schemas)
                still.append(i)
        active = still
    return answers, calls


def direct(model, tokenizer, rows, max_new_tokens: int, batch: int = 50) -> list[str]:
    """Each row's question answered with no tool listed."""
    contexts = [prompt_ids(tokenizer, row, False) for row in rows]
    turns = []
    for start in range(0, len(contexts), batch):
        turns += greedy_turns(model, tokenizer, contexts[start : start + batch], max_new_tokens)
    return [tokenizer.decode(t, skip_special_tokens=True).strip() for t in turns]


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path, help="model directories (final/, merged/, ...)")
    parser.add_argument("--data", type=Path, default=REPO / "toolkit/assets/demo/agent_eval.jsonl")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96, help="per model turn")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = [json.loads(line) for line in args.data.read_text().splitlines()]
    calculator = load_user_function(str(REPO / CALCULATOR), "calculator")
    environment = Environment({"calculator": calculator}, timeout_s=5)
    for path in args.models:
        result = measure(path, rows, environment, args.max_turns, args.max_new_tokens)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
