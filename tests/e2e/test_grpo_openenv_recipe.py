"""recipes/grpo_llm.py with an OpenEnv environment ftkit serves for the run (tests/openenv_countdown.py): the
server starts beside the run, the conversations' rewards join the total and their steps are logged, the
held-out evaluation plays whole episodes before and after training, and the server is gone when the run
ends. The conversations themselves (several turns, masks, seeds, failures) are
tested on the embedded model in tests/unit/test_grpo_openenv.py."""

import re

import pytest
from helpers import REPO, run_script, short_grpo_args, train_lines

from toolkit.train.metrics import read_metrics

pytest.importorskip("openenv", reason="openenv-core is not installed (pip install 'ftkit[openenv]')")

from toolkit.grpo import openenv  # noqa: E402

STEPS = 2
HELD_OUT = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo-openenv") / "run"
    args = [
        *short_grpo_args(out, STEPS, 8, 4),
        "model.method=lora",
        f"data.train={REPO / 'toolkit' / 'assets' / 'demo' / 'tools_eval.jsonl'}",
        "data.eval_fraction=0.05",
        "data.max_length=224",
        "grpo.num_generations=4",
        "grpo.max_new_tokens=24",
        "grpo.rewards=[length]",
        "grpo.max_turns=3",
        f"grpo.environment.openenv.app={REPO / 'tests' / 'openenv_countdown.py'}:app",
        "grpo.environment.openenv.observation_field=text",
        f"eval.exact_match_samples={HELD_OUT}",
    ]
    return out, run_script(REPO / "recipes" / "grpo_llm.py", args, out).stdout


def test_the_recipe_serves_the_environment_adds_its_rewards_and_stops_it(run):
    run, _ = run
    rows = train_lines(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert row["reward"] == pytest.approx(row["reward_length"] + row["reward_environment"])
        assert row["tool_calls"] == row["turns"] >= 1 and row["tool_errors"] == row["tool_timeouts"] == 0
        # Every episode steps: all are of the kind that called the environment, none failed.
        assert row["reward_with_tool_calls"] == pytest.approx(row["reward"])
        assert not {"reward_without_tool_calls", "reward_with_tool_failures"} & set(row)
    assert any(r["reward_environment"] > 0 for r in rows), "the environment rewards even-length turns"
    log = (run / "openenv-0.log").read_text()
    port = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", log).group(1)
    assert openenv._unhealthy(f"http://127.0.0.1:{port}", 2), "the server stops with the run"


def test_the_held_out_evaluation_plays_episodes_before_and_after(run):
    run, stdout = run
    before, after = [r for r in read_metrics(run / "metrics.jsonl") if "eval_reward_environment" in r]
    assert (before["step"], after["step"]) == (0, STEPS)
    for scores in (before, after):
        # Each of the HELD_OUT conversations steps its episode 1 to grpo.max_turns times, each step
        # rewarded 0 or 1, and none fails; the rows' last assistant turns are the references.
        assert 1 <= scores["eval_turns"] <= 3 and scores["eval_environment_errors"] == 0
        assert 0 <= scores["eval_reward_environment"] <= scores["eval_turns"]
        assert scores["eval_reward_environment"] * HELD_OUT == pytest.approx(
            round(scores["eval_reward_environment"] * HELD_OUT)
        )
        assert 0 <= scores["exact_match"] <= 1
    assert "result: held-out exact match " in stdout
