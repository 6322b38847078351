"""Write the agent demo's data (toolkit/assets/demo/agent_*.jsonl): sums of three or four two-digit numbers,
longer than the embedded model adds in its head (it learned two-number sums in pretraining).

- agent_train.jsonl, agent_eval.jsonl: the question with the `calculator` tool listed, the model's call with
  the whole sum as its expression, the tool's result, and the answer read from it. GRPO trains on the train
  questions (their opening alone reaches it); the eval questions are held out from the files below.
- agent_direct_train.jsonl: other sums with no tool listed, answered directly, so the same model also has a
  way to answer without the tool: the baseline that shows the tool is what makes these sums solvable.
- agent_no_call_train.jsonl: yet other sums with the tool listed but answered directly, without a call. The
  second SFT stage (recipes/configs/demo-agent-start.yaml) mixes them 3 to 2 with the tool conversations, so
  GRPO's start calls the tool on only some questions: when to call is left to GRPO to learn.

`python scripts/build_agent_data.py` (a second): fixed seeds, a rerun writes the same files byte for byte.
"""

import json
import random
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent / "toolkit" / "assets" / "demo"
SEED = 64
NUM_TOOL_TRAIN, NUM_DIRECT_TRAIN, NUM_EVAL = 1000, 500, 200
NUM_NO_CALL_TRAIN = 1500
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Add whole numbers."}}]


def question(numbers, rng):
    """The sum asked in one of a few wordings; the last two list the numbers instead of writing the sum."""
    expression = " + ".join(map(str, numbers))
    listed = ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"
    forms = [
        f"What is {expression}?",
        f"Compute {expression}.",
        f"Add {listed}.",
        f"What is the sum of {listed}?",
    ]
    return rng.choice(forms)


def tool_row(numbers, rng):
    total = str(sum(numbers))
    call = {"name": "calculator", "arguments": {"expression": " + ".join(map(str, numbers))}}
    messages = [
        {"role": "user", "content": question(numbers, rng)},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
        {"role": "tool", "name": "calculator", "content": total},
        {"role": "assistant", "content": total},
    ]
    return {"messages": messages, "tools": TOOLS}


def direct_row(numbers, rng, tools=None):
    messages = [{"role": "user", "content": question(numbers, rng)}]
    row = {"messages": [*messages, {"role": "assistant", "content": str(sum(numbers))}]}
    return row if tools is None else {**row, "tools": tools}


def distinct_sums(count, rng, seen=None):
    """`count` sums of three or four two-digit numbers, no two with the same numbers in any order (nor any
    in `seen`, which collects them)."""
    seen, sums = set() if seen is None else seen, []
    while len(sums) < count:
        numbers = tuple(rng.randint(10, 99) for _ in range(rng.choice((3, 4))))
        if tuple(sorted(numbers)) not in seen:
            seen.add(tuple(sorted(numbers)))
            sums.append(numbers)
    return sums


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main(folder: Path = DEMO):
    rng, seen = random.Random(SEED), set()
    sums = distinct_sums(NUM_EVAL + NUM_TOOL_TRAIN + NUM_DIRECT_TRAIN, rng, seen)
    held, tool, direct = sums[:NUM_EVAL], sums[NUM_EVAL:-NUM_DIRECT_TRAIN], sums[-NUM_DIRECT_TRAIN:]
    write_jsonl(folder / "agent_eval.jsonl", [tool_row(s, rng) for s in held])
    write_jsonl(folder / "agent_train.jsonl", [tool_row(s, rng) for s in tool])
    write_jsonl(folder / "agent_direct_train.jsonl", [direct_row(s, rng) for s in direct])
    # Its own stream after the files above, which stay as they were before it was added.
    rng = random.Random(SEED + 1)
    no_call = distinct_sums(NUM_NO_CALL_TRAIN, rng, seen)
    write_jsonl(folder / "agent_no_call_train.jsonl", [direct_row(s, rng, TOOLS) for s in no_call])
    print(
        f"wrote {len(tool)} tool, {len(no_call)} tool-listed direct, {len(direct)} direct training and "
        f"{len(held)} held-out sums to {folder}"
    )


if __name__ == "__main__":
    main()
