"""Agent and reasoning conversations: layouts, and masks checked token by token under templates shaped
like the main model families (written here, for a tokenizer trained here)."""

from __future__ import annotations

import logging

import pytest
from helpers import REPO
from test_data import (
    CHATML,
    bpe,  # noqa: F401  (fixture)
    build_error,
    config,
    make_tokenizer,
    trained_runs,
    write_jsonl,
)
from transformers import AutoTokenizer

from toolkit import data
from toolkit.commands.check_config import check_chat_rows
from toolkit.config import load_config
from toolkit.data.agreement import first_disagreement
from toolkit.data.formats import to_example
from toolkit.data.sources import read_source
from toolkit.errors import UserError
from toolkit.preference.records import detect_layout, to_pair

pytestmark = pytest.mark.usefixtures("private_cache")

IGNORE = -100
# Llama-3.1 shape: tools listed in a system header, calls as one JSON object with "parameters", tool
# results in an "ipython" turn, content trimmed, no newline between turns.
LLAMA31 = """{{- '<|begin_of_text|>' }}
{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nFunctions you can call:\\n' }}
{%- for t in tools %}{{- t | tojson + '\\n' }}{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}
{%- for m in messages %}
{%- set role = 'ipython' if m['role'] == 'tool' else m['role'] %}
{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}
{%- if m.get('tool_calls') %}{%- for c in m['tool_calls'] %}
{{- {'name': c['function']['name'], 'parameters': c['function']['arguments']} | tojson }}
{%- endfor %}{%- else %}{{- m['content'] | trim }}{%- endif %}{{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""
# Qwen2.5 shape: tools inside the system turn, calls in <tool_call> tags, consecutive tool results
# grouped into one user turn of <tool_response> blocks.
QWEN25 = """
{%- if tools %}{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}
{{- '<tools>\\n' }}{%- for t in tools %}{{- t | tojson + '\\n' }}{%- endfor %}{{- '</tools><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m['role'] == 'tool' %}
{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}
{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif m['role'] != 'system' or not loop.first %}
{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') }}
{%- for c in m.get('tool_calls') or [] %}
{{- '\\n<tool_call>\\n' + {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}
{{- '\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
# Qwen3 shape: answers after the last user turn carry a <think> block (an empty one when the message has
# no reasoning); earlier answers lose their reasoning.
QWEN3 = """
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for m in messages %}
{{- '<|im_start|>' + m['role'] + '\\n' }}
{%- if m['role'] == 'assistant' and loop.index0 > ns.last_user %}
{{- '<think>\\n' + (m.get('reasoning_content') or '') + '\\n</think>\\n\\n' }}
{%- endif %}
{{- m['content'] + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
CALL = {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}
AGENT = {
    "messages": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+3?"}]},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c0", "name": "calculator", "content": "5"},
        {"role": "tool", "tool_call_id": "c1", "name": "calculator", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
    ],
    "tools": TOOLS,
}
JSON_CALL = '{"name": "calculator", "arguments": {"expression": "2+3"}}'


def encode(tmp_path, tokenizer, records, **overrides):
    path = write_jsonl(tmp_path / "agent.jsonl", records)
    train, _, _ = data.build_datasets(config(path, **overrides), tokenizer, 0)
    return train


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (
            LLAMA31,
            ['{"name": "calculator", "parameters": {"expression": "2+3"}}<|eot_id|>', "It is 5.<|eot_id|>"],
        ),
        # Qwen2.5 writes the (empty) content, then a newline before each call: both are the answer's.
        (QWEN25, [f"\n<tool_call>\n{JSON_CALL}\n</tool_call><|im_end|>", "It is 5.<|im_end|>"]),
        (None, [f"<tool_call>\n{JSON_CALL}\n</tool_call><|im_end|>", "It is 5.<|im_end|>"]),
    ],
    ids=["llama3.1", "qwen2.5", "chatml-fallback"],
)
def test_tool_calls_are_trained_and_results_schemas_prompts_never(tmp_path, bpe, template, expected):  # noqa: F811
    tokenizer = make_tokenizer(bpe, template)
    row = encode(tmp_path, tokenizer, [AGENT])[0]
    example = to_example(AGENT, "messages", "x")
    text = tokenizer.apply_chat_template(example["messages"], tools=example["tools"], tokenize=False)
    assert tokenizer.decode(row["input_ids"]) == text
    assert "calculator" in text.split("<|")[1] or template is LLAMA31  # the schema is in the prompt
    assert trained_runs(tokenizer, row) == expected


def test_reasoning_is_trained_unless_left_out_and_inserted_empty_thinking_never(tmp_path, bpe):  # noqa: F811
    tokenizer = make_tokenizer(bpe, QWEN3)
    reasoned = {
        "messages": [
            {"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": "5", "reasoning_content": "two plus three"},
        ]
    }
    plain = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    rows = encode(tmp_path, tokenizer, [reasoned, plain])
    assert trained_runs(tokenizer, rows[0]) == ["<think>\ntwo plus three\n</think>\n\n5<|im_end|>"]
    assert "<think>\n\n</think>" in tokenizer.decode(rows[1]["input_ids"])
    assert trained_runs(tokenizer, rows[1]) == ["Hello<|im_end|>"]
    rows = encode(tmp_path, tokenizer, [reasoned], train_reasoning=False)
    assert trained_runs(tokenizer, rows[0]) == ["5<|im_end|>"]


def test_a_template_that_drops_earlier_reasoning_is_one_line_naming_the_message(tmp_path, bpe):  # noqa: F811
    tokenizer = make_tokenizer(bpe, QWEN3)
    turns = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "r"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": turns}])
    message = build_error(config(path), tokenizer)
    assert message.startswith(f"{path}:1: message 1: the chat template is not prefix-stable (")


def test_a_template_that_ignores_tool_calls_is_one_line(tmp_path, bpe):  # noqa: F811
    path = write_jsonl(tmp_path / "a.jsonl", [AGENT])
    assert build_error(config(path), make_tokenizer(bpe, CHATML)) == (
        f"{path}:1: message 2: the chat template does not write tool calls ('calculator' is missing from "
        "the turn); use a template that renders tool_calls"
    )


def test_turns_marked_untrained_are_not_trained(tmp_path, bpe):  # noqa: F811
    tokenizer = make_tokenizer(bpe, QWEN25)
    turns = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "first", "train": False},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "second", "weight": 0},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "third"},
    ]
    row = encode(tmp_path, tokenizer, [{"messages": turns}])[0]
    assert trained_runs(tokenizer, row) == ["third<|im_end|>"]


def test_sharegpt_function_call_and_observation_with_system_and_tools_columns():
    record = {
        "conversations": [
            {"from": "human", "value": "What is 2+3?"},
            {"from": "function_call", "value": JSON_CALL},
            {"from": "observation", "value": "5"},
            {"from": "gpt", "value": "It is 5."},
        ],
        "system": "Use tools.",
        "tools": '[{"name": "calculator", "parameters": {"type": "object"}}]',
    }
    example = to_example(record, "sharegpt", "f:1")
    assert example["tools"] == [{"name": "calculator", "parameters": {"type": "object"}}]
    assert [m["role"] for m in example["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}
    assert example["messages"][2] == {"role": "assistant", "content": "", "tool_calls": [call]}


def test_alpaca_system_and_history_become_turns():
    record = {"instruction": "q2", "output": "a2", "system": "s", "history": [["q1", "a1"]]}
    messages = to_example(record, "alpaca", "f:1")["messages"]
    assert [(m["role"], m["content"]) for m in messages] == [
        ("system", "s"),
        ("user", "q1"),
        ("assistant", "a1"),
        ("user", "q2"),
        ("assistant", "a2"),
    ]


@pytest.mark.parametrize(
    ("record", "error"),
    [
        (
            {"chosen": "a", "rejected": "b", "prompt": "p"},
            "are preference pairs (chosen, rejected); train them",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}],
                    }
                ]
            },
            "messages[0]: field 'tool_calls[0].arguments' is not valid JSON (",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0]: field 'content'[0] is an 'image_url' part without its 'image_url'",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}], "tools": "{bad"},
            "field 'tools' is not valid JSON (",
        ),
        (
            {"messages": [{"role": "tool", "content": "a", "tool_calls": [CALL]}]},
            "messages[0]: field 'tool_calls' is only for assistant turns, not tool",
        ),
    ],
    ids=["pairs-to-sft", "call-arguments", "image-part", "tools-json", "calls-on-tool"],
)
def test_mistakes_are_one_line_naming_file_line_and_field(tmp_path, bpe, record, error):  # noqa: F811
    path = write_jsonl(tmp_path / "bad.jsonl", [record])
    message = build_error(config(path), make_tokenizer(bpe))
    assert message.startswith(f"{path}:1: ")
    assert error in message


def test_ranking_layout_and_tool_calls_in_preference_pairs():
    record = {
        "conversations": [{"from": "human", "value": "What is 2+3?"}],
        "chosen": {"from": "function_call", "value": JSON_CALL},
        "rejected": {"from": "gpt", "value": "6"},
        "system": "Use tools.",
        "tools": TOOLS,
    }
    pair = to_pair(record, detect_layout(record, "f:1"), "f:1")
    assert pair.prompt == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "What is 2+3?"},
    ]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}
    assert pair.chosen == [{"role": "assistant", "content": "", "tool_calls": [call]}]
    assert pair.rejected == [{"role": "assistant", "content": "6"}] and pair.tools == TOOLS
    explicit = {"prompt": "What is 2+3?", "chosen": [AGENT["messages"][2]], "rejected": "6"}
    assert to_pair(explicit, "explicit", "f:1").chosen[0]["tool_calls"] == [call]


def test_an_sft_file_given_to_preference_tuning_names_the_recipe():
    with pytest.raises(UserError) as caught:
        detect_layout({"messages": []}, "f.jsonl:1")
    assert str(caught.value) == (
        "f.jsonl:1: keys [messages] are SFT data (messages layout), not preference pairs; "
        "train them with recipes/finetune_llm.py"
    )


def test_a_template_that_serves_other_text_than_it_trained_is_one_warning(tmp_path, bpe, caplog, monkeypatch):  # noqa: F811
    # Shaped like reasoning models whose generation prompt opens a <think> block that training text
    # of answers without reasoning never has.
    opens_thinking = CHATML.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
    tokenizer = make_tokenizer(bpe, opens_thinking)
    agreeing = {"messages": [{"role": "user", "content": "a"}]}
    conversation = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = write_jsonl(tmp_path / "m.jsonl", [agreeing, conversation])
    source = read_source(path, "train")
    found = first_disagreement(tokenizer, source, "messages")
    assert found == (
        f"{path}:2: message 1: the chat template's generation prompt differs from the training text at "
        "character 51: trained 'b<|im_end|>\\n', served '<think>\\n'"
    )
    assert first_disagreement(make_tokenizer(bpe, CHATML), source, "messages") is None
    with caplog.at_level(logging.WARNING):
        data.build_datasets(config(path, assistant_only_loss=False), tokenizer, 0)
    assert [r.getMessage() for r in caplog.records if "generation prompt" in r.getMessage()] == [found]
    # `ftkit check-config` reports it too (the tokenizer stands in for the configured model's).
    monkeypatch.setattr("toolkit.commands.check_config.load_tokenizer", lambda cfg: tokenizer)
    cfg = load_config(None)
    cfg.data.train = path
    assert check_chat_rows(cfg) == f"warning: {found}"
    monkeypatch.setattr(
        "toolkit.commands.check_config.load_tokenizer", lambda cfg: make_tokenizer(bpe, CHATML)
    )
    assert check_chat_rows(cfg).startswith("chat template: generation prompts agree")


def test_the_shipped_tool_demo_trains_the_call_and_the_answer(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(REPO / "toolkit/assets/tiny-llama")
    path = REPO / "toolkit/assets/demo/tools_eval.jsonl"
    train, _, _ = data.build_datasets(config(str(path), max_length=224), tokenizer, 0)
    assert len(train) == 200
    call = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "19 + 36"}}\n</tool_call><|im_end|>'
    )
    assert trained_runs(tokenizer, train[0]) == [call, "55<|im_end|>"]
