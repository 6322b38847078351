"""recipes/grpo_llm.py with a tool environment (the demo's calculator) on HF generate: the multi-turn rollout
runs in the recipe, logs its turn and tool counts and the reward of each kind of conversation; DDP x2,
FSDP2 x2 and ZeRO-3 x2 give one process's per-step loss and gradient (each conversation's turns are seeded
by the completion and the turn alone); and a relaunch after a stop inside a round of conversations (two
steps a round) trains on the saved conversations, giving the uninterrupted run's steps exactly. The held-out
evaluation runs whole conversations with the tools, the same sharded as on one process.

The model is the scripted agent (tests/scripted_agent.py): it answers "7" or opens tool calls and closes
them with "</tool_call>" (no end token), which the environment answers with an error turn (the call's body
is not JSON) before the model's next turn. Turn by turn: tests/unit/test_grpo_turns.py.
"""

import json
import shutil
from pathlib import Path

import pytest
import scripted_agent
from helpers import REPO, run_script, short_grpo_args, train_lines

from toolkit.grpo import samples
from toolkit.train.metrics import read_metrics

RECIPE = REPO / "recipes" / "grpo_llm.py"
CALCULATOR = f"{REPO / 'toolkit' / 'assets' / 'demo' / 'calculator.py'}:calculator"
TOOLS_DATA = REPO / "toolkit" / "assets" / "demo" / "tools_eval.jsonl"
STEPS = 3


def held_out_rows(folder: Path) -> Path:
    """Four tool conversations, two of them with "7" as their last assistant turn: the scripted agent's
    greedy turn is "7" (its turn start's two successors tie, the tie goes to "7"), so before training the
    held-out conversations score exact match 0.5, no tool call, one turn each, on every layout."""
    rows = [json.loads(line) for line in TOOLS_DATA.read_text().splitlines()][:4]
    for row in rows[::2]:
        row["messages"][-1]["content"] = "7"
    path = folder / "held.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run_agent(out: Path, model: Path, processes: int = 0, config: str = "", overrides=()):
    args = [
        *short_grpo_args(out, STEPS, 8, 2),
        f"model.path={model}",
        "model.method=lora",
        "train.learning_rate=2e-3",
        f"data.train={TOOLS_DATA}",
        f"data.eval={model.parent / 'held.jsonl'}",
        "eval.exact_match_samples=4",
        "data.max_length=224",
        "grpo.num_generations=4",
        "grpo.max_new_tokens=128",
        "grpo.rewards=[length,format]",
        "grpo.format_pattern=.*7.*",
        f"grpo.environment.tools=[{CALCULATOR}]",
        "grpo.max_turns=3",
        *overrides,
    ]
    return run_script(RECIPE, args, out, processes, config)


# Two optimizer steps per round of conversations (round 0: steps 1-2, round 1: step 3), one process's run
# checkpointed every step: the reference of every layout and the run a relaunch resumes.
ROUNDS = ("grpo.steps_per_generation=2",)
KINDS = ("reward_with_tool_calls", "reward_without_tool_calls", "reward_with_tool_failures")
SAME = ("reward", "completion_len", "turns", "tool_calls", "tool_errors")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """(the scripted agent's folder, one process's output_dir)."""
    folder = tmp_path_factory.mktemp("grpo-agent")
    model = scripted_agent.build(folder / "agent")
    held_out_rows(folder)
    run_agent(folder / "one", model, overrides=(*ROUNDS, "train.save_every_steps=1"))
    return model, folder / "one"


@pytest.fixture(scope="module")
def runs(single):
    """The per-step lines of one process and of DDP x2."""
    model, one = single
    run_agent(one.parent / "two", model, processes=2, config="ddp", overrides=ROUNDS)
    return train_lines(one), train_lines(one.parent / "two")


def test_each_kind_of_conversation_logs_its_reward_the_same_on_two_processes(runs):
    one, two = runs
    assert_reward_kinds(one)
    assert_same_kinds(one, two, "ddp")


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("config", "gather"),
    [("fsdp", True), ("fsdp", False), ("zero3", True)],
    ids=["fsdp2-gathered", "fsdp2-lockstep", "zero3"],
)
def test_sharded_on_two_processes_matches_one(single, config, gather):
    """FSDP2 gathers the whole model once for a round's turns (grpo.gather_for_generation), or generates
    in lockstep, each layer gathered as it runs and the root's own weights around the round's turns (a
    round starting after a training step, which sharded them again); ZeRO-3 gathers its partitions for the
    round, here after an evaluation each step too (whose forward passes without gradients leave partitions
    fetched: gathered on top of them, generation ran on empty weights): the same conversations every way,
    so the same steps and the same held-out conversations."""
    model, one = single
    out = one.parent / f"{config}-{gather}"
    overrides = (*ROUNDS, f"grpo.gather_for_generation={str(gather).lower()}")
    overrides += ("train.eval_every_steps=1",) if config == "zero3" else ()
    run_agent(out, model, processes=2, config=config, overrides=overrides)
    assert_same_steps(train_lines(one), train_lines(out), f"{config} gather={gather}")
    assert_held_out_conversations(one, out)
    if config == "zero3":  # the evaluations between rounds ran
        evaluated = {r["step"] for r in read_metrics(out / "metrics.jsonl") if "eval_loss" in r}
        assert {1, 2} <= evaluated, evaluated


def assert_held_out_conversations(one: Path, out: Path) -> None:
    """The held-out conversations with tools (toolkit/grpo/held_out.py), scored before and after training:
    0.5 exact match before (held_out_rows), and the same scores as one process's after training, generated
    on sharded processes (in lockstep: every generate call collective)."""
    scores = ("step", "exact_match", "eval_tool_call_share", "eval_turns")
    ones, outs = ([[r[k] for k in scores] for r in eval_lines(run)] for run in (one, out))
    assert ones[0] == outs[0] == [0, 0.5, 0.0, 1.0]
    assert len(ones) == len(outs) == 2 and ones[1][0] == STEPS and outs[1] == pytest.approx(ones[1])
    assert 0 <= ones[1][1] <= 1 and 1 <= ones[1][3] <= 3


def eval_lines(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "eval_turns" in r]


def test_a_relaunch_after_a_stop_inside_a_round_resumes_exactly(single, tmp_path):
    """Stopped after step 1, its round of conversations half trained: the relaunch trains step 2 on the
    saved round (completions, masks, counts, old log-probs), then samples round 1 itself."""
    model, one = single
    copy = tmp_path / "run"
    shutil.copytree(one, copy)
    for later in (copy / "checkpoints").glob("step-*"):
        if int(later.name[5:]) > 1:
            shutil.rmtree(later)
    shutil.rmtree(copy / "final")
    result = run_agent(copy, model, overrides=(*ROUNDS, "train.save_every_steps=1"))
    assert "resum" in result.stdout
    expected, got = train_lines(one), train_lines(copy)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(expected, got, strict=True):
        for key in ("loss", "grad_norm", "advantage_std", *SAME, *KINDS):
            assert b.get(key) == a.get(key), (a["step"], key)


def assert_same_steps(expected: list[dict], got: list[dict], label: str) -> None:
    """The loss within 1e-3, the gradient norm within 1e-5 relative (measured: FSDP2's within 1.2e-7, its
    sharded reduction summing in another order; its loss equal to the last digit), the rest equal."""
    assert [r["step"] for r in got] == [r["step"] for r in expected], label
    for a, b in zip(expected, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-3), (label, a["step"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (label, a["step"])
        for key in SAME:
            assert b[key] == pytest.approx(a[key], rel=1e-6), (label, a["step"], key)
    assert_same_kinds(expected, got, label)


def assert_same_kinds(expected: list[dict], got: list[dict], label: str) -> None:
    """Every step logs the same kinds of conversation, each with the same mean reward."""
    for a, b in zip(expected, got, strict=True):
        assert [k for k in KINDS if k in b] == [k for k in KINDS if k in a], (label, a["step"])
        for key in (k for k in KINDS if k in a):
            assert b[key] == pytest.approx(a[key], rel=1e-6), (label, a["step"], key)


def assert_reward_kinds(lines: list[dict]) -> None:
    """Each step logs the mean reward of the kinds of conversation it holds, none of a kind it lacks (every
    call of the scripted agent fails: calling a tool and failing are one kind here); the step's reward lies
    between its kinds' means."""
    assert all(any(k in r for r in lines) for k in KINDS)
    for r in lines:
        assert ("reward_with_tool_calls" in r) == (r["tool_calls"] > 0), r
        assert r.get("reward_with_tool_failures") == r.get("reward_with_tool_calls"), r
        present = [r[k] for k in KINDS[:2] if k in r]
        assert min(present) - 1e-9 <= r["reward"] <= max(present) + 1e-9, r


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


def test_each_rounds_sample_conversations_are_kept_for_the_studio(single, runs):
    """rollouts.jsonl (grpo/samples.py): every round's first groups, the tools' answers as the
    environment's turns, the same on two processes."""
    _, one = single
    rounds = samples.read(one)
    assert [r["round"] for r in rounds] == [1, 0]
    turns = [t["by"] for r in rounds for s in r["samples"] for t in s["turns"]]
    assert turns[0] == "model" and "environment" in turns
    assert samples.read(one.parent / "two") == rounds
