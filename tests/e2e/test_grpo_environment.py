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
