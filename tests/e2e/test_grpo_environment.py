"""recipes/grpo_llm.py with a tool environment (the demo's calculator) on HF generate: the multi-turn rollout
runs in the recipe, logs its turn and tool counts, and two processes give one process's per-step loss and
gradient (each conversation's turns are seeded by the completion and the turn alone).

The model is the scripted agent (tests/scripted_agent.py): it answers "7" or opens tool calls and closes
them with "</tool_call>" (no end token), which the environment answers with an error turn (the call's body
is not JSON) before the model's next turn. Turn by turn: tests/unit/test_grpo_turns.py.
"""

from pathlib import Path

import pytest
import scripted_agent
from helpers import REPO, run_script, short_grpo_args, train_lines

RECIPE = REPO / "recipes" / "grpo_llm.py"
CALCULATOR = f"{REPO / 'toolkit' / 'assets' / 'demo' / 'calculator.py'}:calculator"
STEPS = 3


def run_agent(out: Path, model: Path, processes: int = 0, config: str = ""):
    args = [
        *short_grpo_args(out, STEPS, 8, 2),
        f"model.path={model}",
        "model.method=lora",
        "train.learning_rate=2e-3",
        f"data.train={REPO / 'toolkit' / 'assets' / 'demo' / 'tools_eval.jsonl'}",
        "data.eval_fraction=0.05",
        "data.max_length=224",
        "grpo.num_generations=4",
        "grpo.max_new_tokens=128",
        "grpo.rewards=[length,format]",
        "grpo.format_pattern=.*7.*",
        f"grpo.environment.tools=[{CALCULATOR}]",
        "grpo.max_turns=3",
    ]
    return run_script(RECIPE, args, out, processes, config)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpo-agent")
    model = scripted_agent.build(folder / "agent")
    run_agent(folder / "one", model)
    run_agent(folder / "two", model, processes=2, config="ddp")
    return train_lines(folder / "one"), train_lines(folder / "two")


def test_the_environment_runs_logs_its_counts_and_two_processes_match_one(runs):
    one, two = runs
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, STEPS + 1))
    assert any(r["turns"] > 1 for r in one) and all(r["tool_timeouts"] == 0 for r in one)
    assert all(r["tool_errors"] == r["tool_calls"] for r in one) and any(r["tool_calls"] > 0 for r in one)
    assert any(r["advantage_std"] > 0 for r in one), "the rewards must differ within a group"
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-3), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), a["step"]
        for key in ("reward", "completion_len", "turns", "tool_calls"):
            assert b[key] == pytest.approx(a[key], rel=1e-6), (a["step"], key)


def test_held_out_conversations_are_scored_in_lockstep_on_sharded_processes(tmp_path):
    """The held-out evaluation with tools (toolkit/grpo/held_out.py) on FSDP2 x2 generating layer by layer
    (grpo.gather_for_generation=false: every generate call collective): the scripted agent's greedy turn is
    "7" (its turn start's two successors tie, the tie goes to "7"), so of four held-out tool conversations the
    two whose last assistant turn is "7" count, as on one process (tests/unit/test_grpo_held_out.py)."""
    import json

    from toolkit.train.metrics import read_metrics

    model = scripted_agent.build(tmp_path / "agent")
    tools_data = REPO / "toolkit" / "assets" / "demo" / "tools_eval.jsonl"
    rows = [json.loads(line) for line in tools_data.read_text().splitlines()]
    for row in rows[:4:2]:
        row["messages"][-1]["content"] = "7"
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:4]))
    out = tmp_path / "fsdp"
    args = [
        *short_grpo_args(out, 1, 4, 2),
        f"model.path={model}",
        "model.method=lora",
        f"data.train={tools_data}",
        f"data.eval={tmp_path / 'held.jsonl'}",
        "data.max_length=224",
        "eval.exact_match_samples=4",
        "grpo.num_generations=2",
        "grpo.max_new_tokens=64",
        "grpo.max_turns=3",
        "grpo.gather_for_generation=false",
        "grpo.rewards=[exact_answer]",
        f"grpo.environment.tools=[{CALCULATOR}]",
    ]
    run_script(RECIPE, args, out, processes=2, config="fsdp")
    before, after = [r for r in read_metrics(out / "metrics.jsonl") if "eval_turns" in r]
    scores = ("step", "exact_match", "eval_tool_call_share", "eval_turns")
    assert [before[k] for k in scores] == [0, 0.5, 0.0, 1.0]
    assert after["step"] == 1 and 0 <= after["exact_match"] <= 1 and 1 <= after["eval_turns"] <= 3
