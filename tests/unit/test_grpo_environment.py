"""Multi-turn GRPO: tools and their schemas, tool calls parsed as templates write them, every way a call can
fail becoming a tool turn, conversations scripted turn by turn, and the environment's tokens kept out of the
loss."""

from __future__ import annotations

import contextlib
import copy
import json
import time

import pytest
import torch
from helpers import REPO, micro_llama
from test_agent_data import LLAMA31, QWEN25
from transformers import AutoTokenizer

from toolkit.data.chat import ensure_chat_template
from toolkit.data.encode import IGNORE
from toolkit.engine import client
from toolkit.errors import UserError
from toolkit.grpo import loss as grpo_loss
from toolkit.grpo import multiturn, sampling
from toolkit.grpo import prompts as prompt_sets
from toolkit.grpo import rollout as rollouts
from toolkit.grpo.config import GrpoConfig, GrpoRecipeConfig, load_grpo_config
from toolkit.grpo.environment import Call, Environment, parse_calls

CALCULATOR = f"{REPO / 'toolkit' / 'assets' / 'demo' / 'calculator.py'}:calculator"
TOOLS = '''
import time


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


def broken(x: int) -> int:
    """Fail.

    Args:
        x: anything
    """
    raise RuntimeError("out of order")


FINISHED = []


def nap(seconds: float, tag: int) -> str:
    """Sleep, then say so (each call noted in FINISHED as it ends).

    Args:
        seconds: how long
        tag: what to say
    """
    time.sleep(seconds)
    FINISHED.append(tag)
    return f"woke {tag}"


def untyped(x):
    """No hints.

    Args:
        x: anything
    """
    return x
'''


def environment(tmp_path, *names: str, timeout: float = 5.0) -> Environment:
    (tmp_path / "tools.py").write_text(TOOLS)
    grpo = GrpoConfig()
    grpo.environment.tools = [CALCULATOR, *(f"{tmp_path / 'tools.py'}:{n}" for n in names)]
    grpo.environment.tool_timeout_s = timeout
    return Environment.build(grpo)


def test_calls_are_read_in_the_tagged_and_the_llama3_forms():
    tagged = (
        'Let me add.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>'
    )
    assert parse_calls(tagged) == [Call("calculator", {"expression": "1 + 2"})]
    two = '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
    two += '<tool_call>{"name": "b"}</tool_call>'
    assert parse_calls(two) == [Call("a", {"x": 1}), Call("b", {})]
    assert parse_calls('{"name": "calculator", "parameters": {"expression": "3"}}') == [
        Call("calculator", {"expression": "3"})
    ]
    assert parse_calls("47") == [] and parse_calls('{"answer": 47}') == []
    unreadable = parse_calls("<tool_call>\n{name: calculator}\n</tool_call>")
    assert unreadable[0].name is None and "not JSON" in unreadable[0].problem
    assert (
        "not a JSON object"
        in parse_calls('<tool_call>{"name": "a", "arguments": [1]}</tool_call>')[0].problem
    )


def test_tools_have_the_schemas_chat_templates_take(tmp_path):
    env = environment(tmp_path, "broken")
    assert env.schemas[0] == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Add or subtract whole numbers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": 'the sum to work out, e.g. "38 + 47"'}
                },
                "required": ["expression"],
            },
            "return": {"type": "string"},
        },
    }
    assert env.schemas[1]["function"]["parameters"]["properties"]["x"]["type"] == "integer"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("untyped", "grpo.environment.tools: untyped: no JSON schema from its signature"),
        ("missing", "grpo.environment.tools: .*tools.py has no function missing"),
    ],
)
def test_a_tool_without_type_hints_or_not_there_is_one_line(tmp_path, spec, message):
    with pytest.raises(UserError, match=message) as caught:
        environment(tmp_path, spec)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["grpo.max_turns=0"], "grpo.max_turns: 0 must be at least 1"),
        (
            ["grpo.environment.tools=[nowhere_module:f]"],
            "grpo.environment.tools: cannot import nowhere_module",
        ),
        (
            ["grpo.environment.tools=[calculator]"],
            "grpo.environment.tools: 'calculator' is not module:function",
        ),
        (["grpo.environment.tools=[./none.py:f]"], r"grpo.environment.tools: ./none.py does not exist"),
    ],
)
def test_bad_environment_settings_are_one_line(overrides, message):
    """Refused as the config loads, before the run writes anything (tests/unit/test_grpo_turns.py runs it)."""
    with pytest.raises(UserError, match=message) as caught:
        load_grpo_config(None, ["model.adapter=null", *overrides])
    assert "\n" not in str(caught.value)


def test_every_failing_call_becomes_a_tool_turn(tmp_path):
    env = environment(tmp_path, "slow", "broken", timeout=0.3)
    assert (env.run(Call("calculator", {"expression": "38 + 47"})).content, "ok") == ("85", "ok")
    cases = {
        "raised": (Call("broken", {"x": 1}), "error", "broken raised RuntimeError: out of order"),
        "refused": (Call("calculator", {"expression": "38 * 47"}), "error", "calculator raised ValueError"),
        "bad arguments": (Call("calculator", {"sum": "1"}), "error", "bad arguments for calculator"),
        "unknown": (Call("abacus", {}), "error", "no tool abacus; the tools are calculator, slow, broken"),
        "unreadable": (Call(None, {}, "the tool call is not JSON (x)"), "error", "the tool call is not JSON"),
        "timeout": (Call("slow", {"seconds": 30}), "timeout", "slow timed out after 0.3 s"),
    }
    started = time.perf_counter()
    for call, kind, text in cases.values():
        result = env.run(call)
        assert (result.kind, text in result.content, result.content.startswith("error: ")) == (
            kind,
            True,
            True,
        )
    assert time.perf_counter() - started < 10, "a timed-out call must not be waited for"


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(REPO / "toolkit" / "assets" / "tiny-llama")
    ensure_chat_template(tok)
    return tok


def scripted(monkeypatch, tokenizer, turns: list[str]):
    """sampling.sample replaced by a model that writes `turns[k]` (then its end token) as its k-th turn;
    returns the seeds each call was given."""
    seen = []

    def sample(policy, contexts, seeds, cfg, pad_id, end_ids, synced, stops=None):
        seen.append(list(seeds))
        turn = len(seen) - 1
        tokens = tokenizer(turns[turn], add_special_tokens=False)["input_ids"] + [end_ids[0]]
        return [tokens[: cfg.max_new_tokens] for _ in contexts]

    monkeypatch.setattr(sampling, "sample", sample)
    monkeypatch.setattr(sampling, "generating", lambda *a: contextlib.nullcontext((None, False)))
    return seen


class FakeRun:
    accelerator = None


def test_a_conversation_calls_the_tool_reads_its_answer_and_answers(monkeypatch, tmp_path, tokenizer):
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "41 + 6"}}\n</tool_call>'
    seen = scripted(monkeypatch, tokenizer, [call, "47"])
    cfg = GrpoRecipeConfig(grpo=GrpoConfig(max_new_tokens=96, max_turns=3))
    talks = multiturn.conversations(
        FakeRun(), None, [[1, 2], [3]], [11, 12], cfg, tokenizer, environment(tmp_path)
    )
    talk = talks[0]
    first = tokenizer(call, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    answer = tokenizer("47", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    said = talk.tokens[len(first) : len(talk.tokens) - len(answer)]
    assert talk.tokens[: len(first)] == first and talk.tokens[-len(answer) :] == answer
    assert talk.trained == [1] * len(first) + [0] * len(said) + [1] * len(answer)
    assert (
        tokenizer.decode(said)
        == "\n<|im_start|>tool\n<tool_response>\n47\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert (talk.answer, talk.done) == ("47", True)
    assert talk.stats == {"turns": 2, "tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0}
    # Each turn has its own seed, a function of the completion's seed and the turn alone.
    assert seen == [[11, 12], [multiturn.turn_seed(11, 1), multiturn.turn_seed(12, 1)]]
    assert multiturn.turn_seed(11, 1) not in (11, multiturn.turn_seed(12, 1), multiturn.turn_seed(11, 2))


def test_a_bad_call_is_answered_and_the_turns_and_budget_end_a_conversation(monkeypatch, tmp_path, tokenizer):
    bad = "<tool_call>\n{oops}\n</tool_call>"
    scripted(monkeypatch, tokenizer, [bad, bad])
    cfg = GrpoRecipeConfig(grpo=GrpoConfig(max_new_tokens=160, max_turns=2))
    (talk,) = multiturn.conversations(FakeRun(), None, [[1]], [5], cfg, tokenizer, environment(tmp_path))
    assert "error: the tool call is not JSON" in tokenizer.decode(talk.tokens)
    assert talk.stats == {"turns": 2, "tool_calls": 2, "tool_errors": 1, "tool_timeouts": 0}
    assert len(talk.tokens) == len(talk.trained) <= 160
    scripted(monkeypatch, tokenizer, [bad, bad])
    cfg.grpo.max_new_tokens = 30  # the tool turn does not fit: cut there, no further model turn
    (talk,) = multiturn.conversations(FakeRun(), None, [[1]], [5], cfg, tokenizer, environment(tmp_path))
    assert len(talk.tokens) == 30 and talk.stats["turns"] == 1 and talk.trained[-1] == 0


def test_the_opening_prompt_stops_before_the_first_assistant_turn():
    row = {"input_ids": list(range(10)), "labels": [IGNORE] * 3 + [3, 4] + [IGNORE] * 3 + [8, 9]}
    prompts = prompt_sets.prompt_set(
        [row], type("T", (), {"decode": lambda self, ids, **k: str(ids)})(), True
    )
    assert prompts.ids == [[0, 1, 2]] and prompts.answers == ["[8, 9]"]


def test_only_the_models_tokens_train():
    """A conversation's environment tokens (mask 0) are context: never a label, no gradient, not counted in
    the per-completion normalisation."""
    prompts = prompt_sets.PromptSet([[3, 4, 5]], [""], [""])
    completions = torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 0, 0]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 0, 0]])
    rollout = rollouts.Rollout(
        0, torch.zeros(2, dtype=torch.long), completions, torch.tensor([6, 4]), {"total": torch.zeros(2)},
        torch.tensor([1.0, -2.0], dtype=torch.float64), None, None, torch.arange(2), mask=mask,
    )  # fmt: skip
    recipe = GrpoRecipeConfig(grpo=GrpoConfig(max_new_tokens=6))
    recipe.train.global_batch_size, recipe.train.micro_batch_size = 2, 2
    (batch,) = rollout.micro_batches(torch.arange(2), prompts, recipe, 0, 0, 1, "cpu")
    assert batch["labels"][0, 3:9].tolist() == [10, 11, IGNORE, IGNORE, 14, 15]
    assert batch["labels"][1, 3:7].tolist() == [20, IGNORE, IGNORE, 23]
    logps = grpo_loss.completion_logps(micro_llama().double(), batch, 1.0).detach().requires_grad_()
    terms = grpo_loss.micro_terms(recipe.grpo, logps, batch)
    terms["objective"].backward()
    trained = logps.grad != 0
    assert trained.tolist() == [
        [True, True, False, False, True, True],
        [True, False, False, True, False, False],
    ]
    # grpo: each completion's mean over its trained tokens: -A / 4 and -A / 2 per trained token.
    assert logps.grad[0, 0].item() == pytest.approx(-1 / 4) and logps.grad[1, 0].item() == pytest.approx(
        2 / 2
    )
    assert rollouts.step_counts(rollout, torch.arange(2), prompts)[0] == 6
    assert torch.equal(rollouts.Rollout.from_state_dict(rollout.state_dict()).mask, mask)


KINDS = ("reward_with_tool_calls", "reward_without_tool_calls", "reward_with_tool_failures")


def test_each_kind_of_conversation_logs_its_mean_reward():
    """Per step: the mean total reward of the conversations that called a tool, of those that called none,
    and of those with a failed call (error or timeout); a kind the step holds none of logs no key; the
    checkpoint's round logs the same; a single-turn round logs none of them."""
    totals = torch.tensor([1.0, 0.5, 0.0, 2.0, -1.0, 3.0], dtype=torch.float64)
    counts = {  # answered call; none; an error; none; a timeout; two calls, one an error
        "turns": torch.tensor([2.0, 1, 2, 1, 2, 3]),
        "tool_calls": torch.tensor([1.0, 0, 1, 0, 1, 2]),
        "tool_errors": torch.tensor([0.0, 0, 1, 0, 0, 1]),
        "tool_timeouts": torch.tensor([0.0, 0, 0, 0, 1, 0]),
    }
    rollout = rollouts.Rollout(
        0, torch.zeros(6, dtype=torch.long), torch.ones(6, 4, dtype=torch.long), torch.full((6,), 4),
        {"format": totals / 2, "total": totals}, totals - totals.mean(), None, None, torch.arange(6),
        turn_stats=counts,
    )  # fmt: skip
    stats = rollouts.StepStats(GrpoRecipeConfig(grpo=GrpoConfig(num_generations=2, max_new_tokens=4)))
    sums = torch.zeros(grpo_loss.SUMMED_TERMS, dtype=torch.float64)
    logged = stats.metrics(rollout, torch.arange(6), sums, 24)
    assert logged["reward_with_tool_calls"] == pytest.approx((1.0 + 0.0 - 1.0 + 3.0) / 4)
    assert logged["reward_without_tool_calls"] == pytest.approx((0.5 + 2.0) / 2)
    assert logged["reward_with_tool_failures"] == pytest.approx((0.0 - 1.0 + 3.0) / 3)
    assert logged["tool_calls"] == pytest.approx(5 / 6) and logged["reward_format"] == pytest.approx(5.5 / 12)
    step = stats.metrics(rollout, torch.tensor([1, 3]), sums, 8)  # no conversation of the step called one
    assert step["reward_without_tool_calls"] == pytest.approx(1.25) and step["tool_errors"] == 0
    assert not {"reward_with_tool_calls", "reward_with_tool_failures"} & set(step)
    step = stats.metrics(rollout, torch.tensor([0, 3]), sums, 8)  # a call, none failed
    assert (step["reward_with_tool_calls"], step["reward_without_tool_calls"]) == (1.0, 2.0)
    assert "reward_with_tool_failures" not in step
    restored = rollouts.Rollout.from_state_dict(rollout.state_dict())
    again = stats.metrics(restored, torch.arange(6), sums, 24)
    assert {k: again[k] for k in KINDS} == {k: logged[k] for k in KINDS}
    rollout.turn_stats = None
    single = stats.metrics(rollout, torch.arange(6), sums, 24)
    assert not (set(KINDS) | set(multiturn.STAT_NAMES)) & set(single)


@pytest.mark.parametrize(
    "template, written, said",
    [
        (
            QWEN25,
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "38 + 47"}}\n</tool_call>',
            "\n<|im_start|>user\n<tool_response>\n85\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            LLAMA31,
            '{"name": "calculator", "parameters": {"expression": "38 + 47"}}',
            "<|start_header_id|>ipython<|end_header_id|>\n\n85<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
    ],
)
def test_tool_turns_are_written_as_qwen_and_llama3_templates_write_them(
    tmp_path, tokenizer, template, written, said
):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    env = environment(tmp_path)
    calls = parse_calls(written)
    results = [env.run(call) for call in calls]
    ids = multiturn.environment_turns(tok, written, calls, results, env.schemas)
    assert tok.decode(ids) == said


def napping_turn(turn: int, rows: int, tokenizer) -> list[list[int]]:
    """Turn `turn` of `rows` scripted conversations: first each row's tool calls, in their order a slow call
    that times out, a call that fails, two naps in one turn, then naps shorter row after row (so a turn's
    calls run at once end in reverse); then each row's answer, which ends it."""
    call = lambda name, **arguments: (  # noqa: E731
        f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
    )
    texts = [f"done {k}" for k in range(rows)]
    if turn == 0:
        naps = [call("nap", seconds=round(0.15 * (rows - k), 2), tag=k) for k in range(rows)]
        texts = [
            call("slow", seconds=8),
            call("broken", x=1),
            naps[2] + call("nap", seconds=0, tag=20),
            *naps[3:],
        ]
    return [
        tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for text in texts
    ]


@pytest.mark.parametrize("path", ["hf", "engine"])
def test_a_turns_tool_calls_run_at_once_and_the_conversations_are_those_of_one_at_a_time(
    path, monkeypatch, tmp_path, tokenizer
):
    """With grpo.environment.concurrency the tool calls of a turn run at once across the conversations (they
    end out of order) and give the very conversations calls made one at a time give: tokens, masks, the
    engine's log-probs, messages, counts, the timeout and the error alike; a conversation's own calls keep
    their order."""
    rows, prompts, seeds = 8, [[1, 2]] * 8, list(range(40, 48))
    env = environment(tmp_path, "slow", "broken", "nap", timeout=1.0)
    finished = env.tools["nap"].__globals__["FINISHED"]
    turns = []

    def sample(policy, contexts, seeds, cfg, pad_id, end_ids, synced, stops=None):
        turns.append(len(turns))
        return napping_turn(turns[-1], len(contexts), tokenizer)

    def complete(prompts, seeds, max_tokens, stop_ids, stop):
        return [client.Completion(t, [-0.25] * len(t)) for t in sample(None, prompts, seeds, None, 0, [], 0)]

    monkeypatch.setattr(sampling, "sample", sample)
    monkeypatch.setattr(sampling, "generating", lambda *a: contextlib.nullcontext((None, False)))
    by_concurrency = {}
    for concurrency in (1, rows):
        cfg = GrpoRecipeConfig(grpo=GrpoConfig(max_new_tokens=256, max_turns=3))
        cfg.grpo.environment.concurrency = concurrency
        turns.clear()
        finished.clear()
        if path == "hf":
            talks = multiturn.conversations(FakeRun(), None, prompts, seeds, cfg, tokenizer, env)
        else:
            sampler = type("Sampler", (), {"complete": staticmethod(complete)})()
            talks = multiturn._engine_turns(sampler, prompts, seeds, cfg.grpo, tokenizer, env)
        by_concurrency[concurrency] = talks, list(finished)
    (one_at_a_time, in_turn), (at_once, as_they_ended) = by_concurrency[1], by_concurrency[rows]
    assert at_once == one_at_a_time
    assert in_turn == [2, 20, 3, 4, 5, 6, 7] and sorted(as_they_ended) == sorted(in_turn)
    assert as_they_ended != in_turn and as_they_ended.index(2) < as_they_ended.index(20)
    stats = [talk.stats for talk in at_once]
    assert [s["tool_calls"] for s in stats] == [1, 1, 2, 1, 1, 1, 1, 1] and {s["turns"] for s in stats} == {2}
    assert [(s["tool_timeouts"], s["tool_errors"]) for s in stats[:3]] == [(1, 0), (0, 1), (0, 0)]
    for k, talk in enumerate(at_once):
        assert talk.answer == f"done {k}" and 0 in talk.trained
        if k >= 2:
            assert talk.messages[1]["content"] == f"woke {k}"
        if path == "engine":
            assert talk.logps == [-0.25 if trained else 0.0 for trained in talk.trained]
