"""Multi-turn GRPO beyond the core loop: bad input refused before the run writes anything, a model turn that
ends at its tool call's close, the turn's stops on HF generate and on the engine, and rewards that read the
whole conversation."""

from __future__ import annotations

import contextlib

import pytest
import scripted_agent
import torch
from helpers import REPO, load_recipe, trained_runs
from test_agent_data import LLAMA31
from transformers import AutoModelForCausalLM, AutoTokenizer

from toolkit.data.chat import ensure_chat_template
from toolkit.engine import client, server
from toolkit.errors import USER_ERROR_EXIT_CODE, run_main
from toolkit.grpo import multiturn, sampling
from toolkit.grpo.config import GrpoConfig, GrpoRecipeConfig
from toolkit.grpo.engine import EngineSampler, logprob_gap
from toolkit.grpo.environment import Environment
from toolkit.grpo.rewards import Rewards, TrajectoryReward

CALCULATOR = f"{REPO / 'toolkit' / 'assets' / 'demo' / 'calculator.py'}:calculator"
BUDGET = 96
UNTYPED = '''
def untyped(x):
    """No hints.

    Args:
        x: anything
    """
    return x
'''


@pytest.mark.usefixtures("signal_handlers_restored")
@pytest.mark.parametrize(
    "case, message",
    [
        ("unimportable", "grpo.environment.tools: cannot import nowhere_module"),
        ("untyped", "grpo.environment.tools: untyped: no JSON schema from its signature"),
        ("max_turns", "grpo.max_turns: 0 must be at least 1"),
        ("no engine", "grpo.generation=vllm: no engine environment at"),
        ("reward module", "grpo.rewards: cannot import nowhere_module for nowhere_module:score"),
        ("reward file", "rewards.py has no function score"),
        ("engine url", "grpo.vllm.url: no engine answers at http://127.0.0.1:9/health"),
        ("openenv url", "grpo.environment.openenv: no OpenEnv server answers at http://127.0.0.1:9"),
        ("openenv file", "grpo.environment.openenv.app: ./none.py does not exist"),
        (
            "openenv module",
            "grpo.environment.openenv.app: no module nowhere_module where the run is launched",
        ),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_written(case, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "tools.py").write_text(UNTYPED)
    (tmp_path / "rewards.py").write_text("def other(prompts, completions, answers):\n    return [0.0]\n")
    monkeypatch.setattr(server, "ENGINE_VENV", tmp_path / "no-venv")  # whether or not this checkout has one
    overrides = {
        "unimportable": ["grpo.environment.tools=[nowhere_module:f]"],
        "untyped": [f"grpo.environment.tools=[{tmp_path / 'tools.py'}:untyped]"],
        "max_turns": ["grpo.max_turns=0"],
        "no engine": ["grpo.generation=vllm", f"grpo.environment.tools=[{CALCULATOR}]"],
        "reward module": ["grpo.rewards=[exact_answer,nowhere_module:score]"],
        "reward file": [f"grpo.rewards=[{tmp_path / 'rewards.py'}:score]"],
        "engine url": ["grpo.generation=vllm", "grpo.vllm.url=http://127.0.0.1:9"],
        "openenv url": ["grpo.environment.openenv.url=http://127.0.0.1:9"],
        "openenv file": ["grpo.environment.openenv.app=./none.py:app"],
        "openenv module": ["grpo.environment.openenv.app=nowhere_module:app"],
    }[case]
    out = tmp_path / "run"
    argv = [f"output_dir={out}", "model.adapter=null", *overrides]
    assert run_main(load_recipe("grpo_llm").main, argv, "grpo_llm") == USER_ERROR_EXIT_CODE
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists()


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """The scripted agent (tests/scripted_agent.py) and its tokenizer."""
    folder = scripted_agent.build(tmp_path_factory.mktemp("agent"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ensure_chat_template(tokenizer)
    return AutoModelForCausalLM.from_pretrained(folder).eval(), tokenizer


def agent_prompt(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": "ping the server"}]
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )


def hf_conversations(monkeypatch, model, tokenizer, seeds):
    monkeypatch.setattr(sampling, "generating", lambda *a: contextlib.nullcontext((model, False)))
    cfg = GrpoRecipeConfig(grpo=GrpoConfig(max_new_tokens=BUDGET, max_turns=3))
    cfg.grpo.environment.tools = [CALCULATOR]
    environment = Environment.build(cfg.grpo)
    prompt = agent_prompt(tokenizer)
    run = type("Run", (), {"accelerator": None})
    return multiturn.conversations(run, model, [prompt] * len(seeds), seeds, cfg, tokenizer, environment)


SEEDS = list(range(100, 116))


@pytest.fixture(scope="module")
def sampled(agent):
    """The scripted agent's conversations for SEEDS, sampled together with HF generate."""
    with pytest.MonkeyPatch.context() as patch:
        return hf_conversations(patch, *agent, SEEDS)


def test_a_turn_ends_at_its_tool_calls_close_and_the_environment_answers_there(monkeypatch, agent, sampled):
    model, tokenizer = agent
    seeds, talks = SEEDS, sampled
    closes, answered = 0, 0
    for talk in talks:
        runs = trained_runs(talk)
        assert [trained for trained, _ in runs] == [1, 0] * (len(runs) // 2) + [1] * (len(runs) % 2)
        assert talk.stats["turns"] == (len(runs) + 1) // 2
        for k, (trained, tokens) in enumerate(runs):
            text = tokenizer.decode(tokens, skip_special_tokens=False)
            cut = k + 1 == len(runs) and len(talk.tokens) == BUDGET  # the budget ran out in it
            if trained:  # the model's turn: its end token, or the first close of a call and nothing after
                assert text.endswith(("<|im_end|>", "</tool_call>")) or cut, text
                assert text.count("</tool_call>") <= 1, text
                closes += text.endswith("</tool_call>") and k + 1 < len(runs)
            else:  # the template's end of the model's turn first, then the tool's answer, then a new turn
                assert text.startswith("<|im_end|>\n<|im_start|>tool\n<tool_response>\nerror: "), text
                assert text.endswith("<|im_start|>assistant\n") or cut, text
                answered += 1
        assert [m["role"] for m in talk.messages][::2] == ["assistant"] * talk.stats["turns"]
    assert closes == answered > 0 and sum(t.stats["tool_errors"] for t in talks) == answered
    assert any(t.answer == "7" for t in talks) and any(t.stats["turns"] > 1 for t in talks)
    # Each row stops on its own tokens: the same conversations sampled one by one.
    for seed, talk in zip(seeds[:3], talks[:3]):
        (alone,) = hf_conversations(monkeypatch, model, tokenizer, [seed])
        assert (alone.tokens, alone.trained) == (talk.tokens, talk.trained)


def test_the_turn_ends_each_template_writes():
    tokenizer = AutoTokenizer.from_pretrained(REPO / "toolkit" / "assets" / "tiny-llama")
    ensure_chat_template(tokenizer)
    ends = multiturn.TurnEnds.of(tokenizer)
    assert ends.ids == [tokenizer.eos_token_id] and ends.strings.strings == ["</tool_call>"]
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|eom_id|>"]})
    tokenizer.chat_template = LLAMA31
    ends = multiturn.TurnEnds.of(tokenizer)
    assert ends.ids == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|eom_id|>")]
    assert not ends.strings and ends.closed([5, ends.ids[1]]) == "token" and ends.closed([5]) is None
    stops = sampling.StopStrings(["ab"], lambda tokens: "".join(chr(96 + t) for t in tokens))
    assert stops.cut([3, 1, 2, 1, 2]) == [3, 1, 2] and stops.cut([1, 1]) == [1, 1]


def test_on_the_engine_the_main_process_asks_each_turn_and_keeps_the_models_log_probs(
    monkeypatch, agent, sampled
):
    """EngineSampler's turns through client.complete, answered here by the scripted agent as the engine
    would (its seed, its budget, its stop strings kept): the same conversations as HF generate's, the
    engine's log-probs on the model's tokens and none on the environment's."""
    model, tokenizer = agent
    seeds, expected = SEEDS[:8], sampled[:8]
    payloads = []

    def post(url, path, payload):
        payloads.append(payload)
        limits = GrpoConfig(max_new_tokens=payload["max_tokens"])
        decode = lambda tokens: tokenizer.decode(tokens, skip_special_tokens=False)  # noqa: E731
        stops = sampling.StopStrings(payload.get("stop", []), decode)
        ends = payload["stop_token_ids"]
        (tokens,) = sampling.sample(
            model, [payload["prompt"]], [payload["seed"]], limits, 3, ends, False, stops
        )
        logps = [-1.0 - 0.01 * t for t in tokens]
        return {"choices": [{"token_ids": tokens, "logprobs": {"token_logprobs": logps}}]}

    monkeypatch.setattr(client, "post", post)
    cfg = GrpoRecipeConfig(grpo=GrpoConfig(max_new_tokens=BUDGET, max_turns=3))
    cfg.grpo.environment.tools = [CALCULATOR]
    held = type("Engine", (), {"url": "http://engine", "check_alive": lambda self: None})()
    engine = EngineSampler(type("Accelerator", (), {"num_processes": 1})(), cfg, held)
    monkeypatch.setattr(engine, "sync", lambda model, round_index: 0.25)
    prompt = agent_prompt(tokenizer)
    requests = lambda round_index: ([prompt] * len(seeds), seeds)  # noqa: E731
    sampled, sync_seconds = multiturn.engine_conversations(
        engine, model, requests, cfg, tokenizer, Environment.build(cfg.grpo), 0
    )
    talks = sampled.talks
    assert sync_seconds == 0.25
    assert [(t.tokens, t.trained, t.stats) for t in talks] == [
        (t.tokens, t.trained, t.stats) for t in expected
    ]
    assert all(p["stop"] == ["</tool_call>"] and p["include_stop_str_in_output"] for p in payloads)
    later = [p for p in payloads if len(p["prompt"]) > len(prompt)]  # second and third turns
    assert later and all(p["max_tokens"] == BUDGET - (len(p["prompt"]) - len(prompt)) for p in later)
    assert {p["seed"] for p in later} <= {multiturn.turn_seed(s, t) for s in seeds for t in (1, 2)}
    table = multiturn.logp_table(talks, BUDGET)
    for i, talk in enumerate(talks):
        for j, (token, trained) in enumerate(zip(talk.tokens, talk.trained, strict=True)):
            assert table[i, j].item() == pytest.approx(-1.0 - 0.01 * token if trained else 0.0)
    # The gap between the engine and the trainer counts the model's tokens only.
    lengths = torch.tensor([len(t.tokens) for t in talks])
    mask = torch.zeros(len(talks), BUDGET, dtype=torch.long)
    for i, talk in enumerate(talks):
        mask[i, : len(talk.trained)] = torch.tensor(talk.trained)
    trainer = table + mask * 0.125 - (1 - mask) * 5.0  # the environment's tokens far off: not counted
    assert logprob_gap(table, trainer, lengths, mask) == pytest.approx((0.125, 0.125))


REWARDS = """
def calls(trajectories):
    return [t["tool_calls"] + 10 * (t["messages"][-1]["content"] == t["answer"]) for t in trajectories]


def answers(prompts, completions, answers):
    return [1.0] * len(completions)
"""


def test_a_reward_on_whole_trajectories_is_declared_by_its_one_parameter(tmp_path, sampled):
    (tmp_path / "rewards.py").write_text(REWARDS)
    grpo = GrpoConfig(rewards=[f"{tmp_path / 'rewards.py'}:calls", f"{tmp_path / 'rewards.py'}:answers"])
    rewards = Rewards.build(grpo)
    assert isinstance(rewards.functions["calls"], TrajectoryReward)
    assert not isinstance(rewards.functions["answers"], TrajectoryReward)
    talks = sampled
    texts = [t.answer for t in talks]
    trajectories = multiturn.trajectories(["p"] * len(talks), ["7"] * len(talks), texts, talks)
    assert trajectories[0]["prompt"] == "p" and trajectories[0]["messages"] == talks[0].messages
    scores = rewards.score(
        ["p"] * len(talks), texts, ["7"] * len(talks), [1] * len(talks), None, trajectories
    )
    expected = [t.stats["tool_calls"] + 10 * (t.answer == "7") for t in talks]
    assert scores["calls"] == expected and len(set(expected)) > 1
    assert scores["total"] == [v + 1.0 for v in expected]
    # Single-turn GRPO: one assistant message per completion.
    (single,) = multiturn.trajectories(["p"], ["7"], [" 7 "], None)
    assert single == {
        "prompt": "p",
        "messages": [{"role": "assistant", "content": "7"}],
        "answer": "7",
        "turns": 1,
        "tool_calls": 0,
        "tool_errors": 0,
        "tool_timeouts": 0,
    }
