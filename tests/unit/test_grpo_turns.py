"""Multi-turn GRPO beyond the core loop: bad input refused before the run writes anything, a model turn that
ends at its tool call's close, the turn's stops on HF generate and on the engine, and rewards that read the
whole conversation."""

from __future__ import annotations

import contextlib

import pytest
import scripted_agent
from helpers import REPO, load_recipe
from test_agent_data import LLAMA31
from transformers import AutoModelForCausalLM, AutoTokenizer

from toolkit.data.chat import ensure_chat_template
from toolkit.engine import server
from toolkit.errors import USER_ERROR_EXIT_CODE, run_main
from toolkit.grpo import multiturn, sampling
from toolkit.grpo.config import GrpoConfig, GrpoRecipeConfig
from toolkit.grpo.environment import Environment

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
    ],
)
def test_bad_input_is_one_line_and_nothing_is_written(case, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "tools.py").write_text(UNTYPED)
    monkeypatch.setattr(server, "ENGINE_VENV", tmp_path / "no-venv")  # whether or not this checkout has one
    overrides = {
        "unimportable": ["grpo.environment.tools=[nowhere_module:f]"],
        "untyped": [f"grpo.environment.tools=[{tmp_path / 'tools.py'}:untyped]"],
        "max_turns": ["grpo.max_turns=0"],
        "no engine": ["grpo.generation=vllm", f"grpo.environment.tools=[{CALCULATOR}]"],
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


def segments(talk) -> list[tuple[int, list[int]]]:
    """(trained, tokens) runs of a conversation: the model's turns and the environment's between them."""
    runs = []
    for token, trained in zip(talk.tokens, talk.trained, strict=True):
        if runs and runs[-1][0] == trained:
            runs[-1][1].append(token)
        else:
            runs.append((trained, [token]))
    return runs


def hf_conversations(monkeypatch, model, tokenizer, seeds):
    monkeypatch.setattr(sampling, "generating", lambda *a: contextlib.nullcontext((model, False)))
    cfg = GrpoRecipeConfig(grpo=GrpoConfig(max_new_tokens=BUDGET, max_turns=3))
    cfg.grpo.environment.tools = [CALCULATOR]
    environment = Environment.build(cfg.grpo)
    prompt = agent_prompt(tokenizer)
    run = type("Run", (), {"accelerator": None})
    return multiturn.conversations(run, model, [prompt] * len(seeds), seeds, cfg, tokenizer, environment)


def test_a_turn_ends_at_its_tool_calls_close_and_the_environment_answers_there(monkeypatch, agent):
    model, tokenizer = agent
    seeds = list(range(100, 116))
    talks = hf_conversations(monkeypatch, model, tokenizer, seeds)
    closes, answered = 0, 0
    for talk in talks:
        runs = segments(talk)
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
    for seed, talk in zip(seeds[:4], talks[:4]):
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
