"""recipes/grpo_llm.py with a tool environment (the demo's calculator) on the embedded model: the multi-turn
rollout runs in the recipe, logs its turn and tool counts, and two processes give one process's per-step
loss (each conversation's turns are seeded by the completion and the turn alone).

The bare embedded model does not write tool calls, so these conversations end after one turn: the tool turns
themselves, their masks and errors are tested turn by turn in tests/unit/test_grpo_environment.py.
"""

from pathlib import Path

import pytest
from helpers import REPO, run_script, train_lines

RECIPE = REPO / "recipes" / "grpo_llm.py"
CALCULATOR = f"{REPO / 'toolkit' / 'assets' / 'demo' / 'calculator.py'}:calculator"
STEPS = 3


def run_agent(out: Path, processes: int = 0, config: str = ""):
    args = [
        f"output_dir={out}",
        "model.adapter=null",
        "model.method=lora",
        "train.learning_rate=2e-3",
        f"train.max_steps={STEPS}",
        "train.log_every_steps=1",
        "train.warmup_steps=0",
        "train.lr_scheduler=constant",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        f"data.train={REPO / 'toolkit' / 'assets' / 'demo' / 'tools_eval.jsonl'}",
        "data.eval=null",
        "data.eval_fraction=0.05",
        "data.max_length=224",
        "eval.exact_match_samples=0",
        "eval.max_batches=0",
        "grpo.num_generations=4",
        "grpo.max_new_tokens=10",
        "grpo.rewards=[length,format]",
        "grpo.format_pattern=.*1.*",
        f"grpo.environment.tools=[{CALCULATOR}]",
        "grpo.max_turns=2",
    ]
    return run_script(RECIPE, args, out, processes, config)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpo-agent")
    run_agent(folder / "one")
    run_agent(folder / "two", processes=2, config="ddp")
    return train_lines(folder / "one"), train_lines(folder / "two")


def test_the_environment_runs_logs_its_counts_and_two_processes_match_one(runs):
    one, two = runs
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, STEPS + 1))
    for row in one:
        assert row["turns"] == 1.0 and row["tool_calls"] == row["tool_errors"] == row["tool_timeouts"] == 0
    assert any(r["advantage_std"] > 0 for r in one), "the rewards must differ within a group"
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-3), a["step"]
        for key in ("reward", "completion_len", "turns"):
            assert b[key] == pytest.approx(a[key], rel=1e-6), (a["step"], key)
