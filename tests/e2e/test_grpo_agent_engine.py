"""recipes/grpo_llm.py with a tool environment sampled on the vLLM engine (grpo.generation=vllm): the scripted
agent (tests/scripted_agent.py, tiny-llama-q64 rebuilt as a token walk) opens and closes tool calls, the
engine stops its turn at "</tool_call>" (kept), the environment answers (an error turn: the call is not JSON)
and the engine samples the next turn. One engine serves both runs (grpo.vllm.url): one process and ZeRO-3 on
two give the same conversations, so the same per-step loss; the saved round shows the masks, and the
engine's log-probs sit on the model's tokens only. A trajectory reward counts each conversation's calls.
The same engine then samples runs whose environment is OpenEnv (tests/openenv_countdown.py, served by ftkit),
on one process and on DDP x2: the main process steps the sessions between turns, so both give the same
rounds; the observations are masked user turns (after the template's end of turn where the model's turn
ended at its close), the episodes' rewards logged; the held-out episodes (HF generate on every process, the
sessions on the main one) score the same on both, and process 1's server is never asked for a session.
With grpo.async_rounds the tools' whole round (engine turns and tool calls) is sent ahead while the round
before trains: it trains one round stale, and a relaunch from a checkpoint that kept the round in flight
logs the very steps of the run that went through.

These need .venv-vllm (`make install-vllm`) and skip, saying so, where it is missing.
"""

import re
import shutil

import pytest
import scripted_agent
import torch
from helpers import REPO, run_script, short_grpo_args, train_lines
from transformers import AutoTokenizer

from toolkit.checkpoint import read_recipe_state
from toolkit.engine.server import ENGINE_VENV, Engine, ServeSpec
from toolkit.grpo import openenv
from toolkit.train.metrics import read_metrics

pytestmark = pytest.mark.skipif(
    not (ENGINE_VENV / ".installed").is_file(),
    reason=f"no engine environment at {ENGINE_VENV}: `make install-vllm` builds it, `make test-vllm` runs it",
)

RECIPE = REPO / "recipes" / "grpo_llm.py"
CALCULATOR = f"{REPO / 'toolkit' / 'assets' / 'demo' / 'calculator.py'}:calculator"
COUNTDOWN = [
    f"grpo.environment.openenv.app={REPO / 'tests' / 'openenv_countdown.py'}:app",
    "grpo.environment.openenv.observation_field=text",
    "eval.exact_match_samples=4",
]
STEPS, BUDGET, LORA_RANK = 2, 128, 8
REWARDS = """
def calls(trajectories):
    return [float(t["tool_calls"]) for t in trajectories]
"""


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """(the scripted agent's folder, a function of (output_dir, *more settings) giving a run's arguments):
    every run of the module is sampled by one engine, stopped once they are done."""
    root = tmp_path_factory.mktemp("grpo-agent-engine")
    model = scripted_agent.build(root / "agent")
    (root / "rewards.py").write_text(REWARDS)
    served = Engine.start(
        ServeSpec(str(model), "float32", 64 + BUDGET, lora_rank=LORA_RANK), root / "vllm.log"
    )
    try:
        served.wait_ready(600)
        yield (
            model,
            lambda out, *more: [
                *short_grpo_args(out, STEPS, 8, 4),
                f"model.path={model}",
                "model.method=lora",
                f"lora.r={LORA_RANK}",
                f"lora.alpha={2 * LORA_RANK}",
                "train.learning_rate=5e-3",
                "train.save_every_steps=1",
                "data.max_length=64",
                "data.eval_fraction=0.02",
                "grpo.num_generations=4",
                f"grpo.max_new_tokens={BUDGET}",
                "grpo.max_turns=3",
                "grpo.beta=0.05",
                f"grpo.rewards=[format,{root / 'rewards.py'}:calls]",
                "grpo.format_pattern=.*7.*",
                "grpo.generation=vllm",
                f"grpo.vllm.url={served.url}",
                *(more or (f"grpo.environment.tools=[{CALCULATOR}]",)),
            ],
        )
    finally:
        served.stop()


@pytest.fixture(scope="module")
def runs(engine, tmp_path_factory):
    """(model folder, one process's run folder, ZeRO-3 x2's, the OpenEnv runs' on one process and DDP x2)."""
    model, args = engine
    root = tmp_path_factory.mktemp("grpo-agent-engine-runs")
    run_script(RECIPE, args(root / "one"), root / "one")
    run_script(RECIPE, args(root / "zero3"), root / "zero3", 2, "zero3")
    run_script(RECIPE, args(root / "openenv", *COUNTDOWN), root / "openenv")
    run_script(RECIPE, args(root / "openenv-ddp", *COUNTDOWN), root / "openenv-ddp", 2, "ddp")
    return model, root / "one", root / "zero3", (root / "openenv", root / "openenv-ddp")


def test_conversations_on_the_engine_match_across_layouts(runs):
    _, one, zero3, _ = runs
    expected, got = train_lines(one), train_lines(zero3)
    assert [r["step"] for r in expected] == [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert any(r["turns"] > 1 for r in expected) and any(r["tool_errors"] > 0 for r in expected)
    assert any(r["reward_calls"] > 0 for r in expected) and all(r["advantage_std"] > 0 for r in expected)
    for a, b in zip(expected, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-3), a["step"]
        # The loss of one update per round is about 0 (ratio 1, advantages centred): the gradient tells.
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4) and a["grad_norm"] > 0, a["step"]
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-3, abs=1e-6), a["step"]
        for key in ("reward", "reward_calls", "completion_len", "turns", "tool_calls", "tool_errors"):
            assert b[key] == pytest.approx(a[key], rel=1e-6), (a["step"], key)
        # Over the model's tokens only: the environment's have no engine log-prob.
        assert a["engine_logprob_gap_max"] < 1e-4 and b["engine_logprob_gap_max"] < 1e-4, a


def test_the_engine_stops_at_the_close_and_only_the_models_tokens_carry_its_log_probs(runs):
    model, one, zero3, _ = runs
    tokenizer = AutoTokenizer.from_pretrained(model)
    rounds = [read_recipe_state(run / "checkpoints" / "step-1") for run in (one, zero3)]
    for key in ("completions", "lengths", "mask", "engine_logps"):
        assert torch.equal(rounds[0][key], rounds[1][key]), key
    state, closes = rounds[0], 0
    rows = zip(state["completions"], state["lengths"], state["mask"], state["engine_logps"], strict=True)
    for tokens, length, mask, logps in rows:
        tokens, mask, logps = tokens[:length].tolist(), mask[:length], logps[:length]
        assert not logps[mask == 0].any() and logps[mask == 1].sum() < 0  # a coin toss: log 1/2 each
        parts = segments(tokens, mask.tolist())
        for trained, part in parts[:-1]:
            text = tokenizer.decode(part, skip_special_tokens=False)
            if trained:  # a turn the environment answered ended at its call's close, kept, and no further
                assert text.endswith("</tool_call>") and text.count("</tool_call>") == 1, text
                closes += 1
            else:
                assert text.startswith("<|im_end|>\n<|im_start|>tool\n<tool_response>\nerror: "), text
    assert closes > 0


def test_openenv_on_the_engine_steps_every_turn_and_masks_the_observations(runs):
    model, _, _, (run, ddp) = runs
    rows = train_lines(run)
    for a, b in zip(rows, train_lines(ddp), strict=True):  # the main process's sessions, shared: one round
        for key in ("reward", "reward_environment", "completion_len", "turns", "tool_calls"):
            assert b[key] == pytest.approx(a[key], rel=1e-6), (a["step"], key)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4) and a["grad_norm"] > 0, a["step"]
    rounds = [read_recipe_state(r / "checkpoints" / "step-1") for r in (run, ddp)]
    for key in ("completions", "lengths", "mask", "engine_logps"):
        assert torch.equal(rounds[0][key], rounds[1][key]), key
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:  # every model turn is one step; the episode's rewards join the total (weight 1)
        assert row["tool_calls"] == row["turns"] >= 1 and row["tool_errors"] == row["tool_timeouts"] == 0
        assert row["reward"] == pytest.approx(
            row["reward_format"] + row["reward_calls"] + row["reward_environment"]
        )
        assert row["engine_logprob_gap_max"] < 1e-4
    assert any(r["turns"] > 1 for r in rows) and any(r["reward_environment"] > 0 for r in rows)
    tokenizer = AutoTokenizer.from_pretrained(model)
    state, answered = rounds[0], 0
    rows = zip(state["completions"], state["lengths"], state["mask"], state["engine_logps"], strict=True)
    for tokens, length, mask, logps in rows:
        tokens, mask, logps = tokens[:length].tolist(), mask[:length], logps[:length]
        assert not logps[mask == 0].any() and logps[mask == 1].sum() < 0
        parts = segments(tokens, mask.tolist())
        for k, (trained, part) in enumerate(parts[:-1]):
            if trained:
                continue
            said = tokenizer.decode(part, skip_special_tokens=False)
            before = tokenizer.decode(parts[k - 1][1], skip_special_tokens=False)
            # A turn ended at its close gets the template's end of turn first; one ended at <|im_end|> has it.
            head = "" if before.endswith("<|im_end|>") else "<|im_end|>"
            assert re.fullmatch(
                re.escape(head) + r"\n<\|im_start\|>user\nyou wrote \d+ characters; \d left<\|im_end\|>\n"
                r"<\|im_start\|>assistant\n",
                said,
            ), said
            answered += 1
    assert answered > 0
    log = (run / "openenv-0.log").read_text()
    port = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", log).group(1)
    assert openenv._unhealthy(f"http://127.0.0.1:{port}", 2), "the server stops with the run"


def test_the_held_out_episodes_score_alike_on_one_process_and_ddp_with_the_main_processs_sessions(runs):
    _, _, _, (run, ddp) = runs
    keys = ("eval_reward_environment", "eval_turns", "eval_environment_errors", "exact_match")
    scored = [
        [r for r in read_metrics(r / "metrics.jsonl") if "eval_reward_environment" in r] for r in (run, ddp)
    ]
    assert [r["step"] for r in scored[0]] == [0, STEPS]
    for one, two in zip(*scored, strict=True):
        assert {k: two[k] for k in keys} == {k: one[k] for k in keys}
        assert one["eval_environment_errors"] == 0 and 1 <= one["eval_turns"] <= 3
    assert any(r["eval_turns"] > 1 for r in scored[0]), "the held-out episodes last several turns"
    # The main process held every session: the rounds' (the engine's) and the held-out episodes'.
    sessions = [(ddp / f"openenv-{rank}.log").read_text().count("WebSocket /ws") for rank in (0, 1)]
    assert sessions[0] > 0 and sessions[1] == 0


def segments(tokens: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """(trained, tokens) runs: the model's turns and the environment's between them."""
    runs = []
    for token, trained in zip(tokens, mask, strict=True):
        if runs and runs[-1][0] == trained:
            runs[-1][1].append(token)
        else:
            runs.append((trained, [token]))
    return runs


# grpo.async_rounds=1 with the tools: four rounds of one step, each kept by a checkpoint.
AHEAD_STEPS = 4
AHEAD = [f"grpo.environment.tools=[{CALCULATOR}]", "grpo.async_rounds=1", f"train.max_steps={AHEAD_STEPS}"]


def test_async_multi_turn_rounds_train_one_round_stale_and_resume_exactly(engine, tmp_path_factory):
    """Stopped after step 2 (round 2's conversations in flight, kept by the checkpoint), relaunched: the
    resumed run trains on the kept round, so it logs the very steps of the run that went through."""
    _, args = engine
    root = tmp_path_factory.mktemp("grpo-agent-engine-ahead")
    run_script(RECIPE, args(root / "run", *AHEAD), root / "run")
    lines = train_lines(root / "run")
    assert [r["step"] for r in lines] == list(range(1, AHEAD_STEPS + 1))
    # Round 0 is sampled before anything trains; every later one with the weights of a round before.
    assert [r["staleness"] for r in lines] == [0] + [1] * (AHEAD_STEPS - 1)
    assert all(r["grad_norm"] > 0 for r in lines) and any(r["turns"] > 1 for r in lines)
    assert lines[0]["engine_logprob_gap_max"] < 1e-4  # the first round's weights are the trainer's
    for before, after in zip(lines, lines[1:]):  # round k+1's requests went out before round k's step ended
        assert after["generation_started_at"] < before["time"]
    kept = read_recipe_state(root / "run" / "checkpoints" / "step-2")
    assert kept["ahead.about"].tolist() == [2, 1], "round 2, sampled by the weights of round 1"
    resumed = root / "resumed"
    shutil.copytree(root / "run", resumed)
    for later in (resumed / "checkpoints").glob("step-*"):
        if int(later.name[5:]) > 2:
            shutil.rmtree(later)
    shutil.rmtree(resumed / "final")
    result = run_script(RECIPE, args(resumed, *AHEAD), resumed)
    assert "resum" in result.stdout
    got = train_lines(resumed)
    assert [r["step"] for r in got] == list(range(1, AHEAD_STEPS + 1))
    keys = ("loss", "reward", "reward_calls", "kl", "grad_norm", "staleness", "turns", "tool_calls")
    for a, b in zip(lines, got, strict=True):
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key)
    # Round 2 trained on the conversations the checkpoint kept, sampled before the stop, not on new ones.
    assert got[2]["generation_started_at"] == lines[2]["generation_started_at"]
