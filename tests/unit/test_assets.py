"""The embedded base model and demo dataset load offline and have the shape the recipes rely on."""

import json
from importlib.resources import files

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ASSETS = files("toolkit") / "assets"
MODEL_DIR = ASSETS / "tiny-llama"
DEMO_DIR = ASSETS / "demo"
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model_and_loading_info():
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, output_loading_info=True)


def read_rows(name):
    return [json.loads(line) for line in (DEMO_DIR / name).read_text().splitlines()]


def test_model_is_a_small_llama_with_grouped_query_attention(model_and_loading_info):
    model, info = model_and_loading_info
    assert not any(info.values()), info
    config = model.config
    assert config.model_type == "llama"
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.max_position_embeddings >= 1024
    assert not config.tie_word_embeddings
    assert (MODEL_DIR / "model.safetensors").stat().st_size < 10 * 2**20


def test_special_tokens_are_single_tokens(tokenizer, model_and_loading_info):
    model, _ = model_and_loading_info
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token not in (None, tokenizer.eos_token)
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", tokenizer.pad_token):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert len(tokenizer) == model.config.vocab_size


def test_chat_template_renders_chatml(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(CONVERSATION[:-1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_assistant_mask_covers_the_answer_and_end_of_turn(tokenizer):
    encoded = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    answer = [t for t, keep in zip(encoded["input_ids"], encoded["assistant_masks"]) if keep]
    assert tokenizer.decode(answer) == "5<|im_end|>"


@pytest.mark.parametrize(
    "text",
    ["Give three tips for staying healthy.", "  tabs\tand\n\nnewlines  ", "Grüße, 東京, 🤖 and ﬁ ligatures"],
)
def test_tokenizer_round_trips_any_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_english_words_are_not_spelled_out_byte_by_byte(tokenizer):
    text = "Write a short story about a friendly robot who wants to learn music."
    assert len(tokenizer.encode(text, add_special_tokens=False)) <= len(text.split()) * 2


def test_generate_continues_a_chat_prompt(tokenizer, model_and_loading_info):
    model, _ = model_and_loading_info
    inputs = tokenizer.apply_chat_template(
        CONVERSATION[:-1], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert output.shape[1] > inputs["input_ids"].shape[1]


@pytest.mark.parametrize(("name", "minimum"), [("train.jsonl", 1000), ("eval.jsonl", 150)])
def test_demo_split_is_messages_format(name, minimum):
    rows = read_rows(name)
    assert len(rows) >= minimum
    for row in rows:
        assert list(row) == ["messages"]
        roles = [m["role"] for m in row["messages"]]
        assert roles in (["user", "assistant"], ["system", "user", "assistant"])
        assert all(isinstance(m["content"], str) and m["content"] for m in row["messages"])


def test_demo_splits_are_disjoint():
    def questions(name):
        return {row["messages"][-2]["content"] for row in read_rows(name)}

    assert not questions("train.jsonl") & questions("eval.jsonl")


def test_the_grpo_demos_start_is_a_whole_adapter_of_the_tiny_model(model_and_loading_info):
    """toolkit/assets/demo-grpo-start (scripts/build_grpo_start.py): it names the repo's base by a relative
    path, and every one of its weights lands on a module of that base."""
    from peft import PeftModel

    start = ASSETS / "demo-grpo-start"
    config = json.loads((start / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "toolkit/assets/tiny-llama" and config["r"] == 16
    base = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    adapted = PeftModel.from_pretrained(base, str(start))
    loaded = [p for name, p in adapted.named_parameters() if "lora_B" in name]
    assert len(loaded) == 7 * base.config.num_hidden_layers
    assert all(p.abs().sum() > 0 for p in loaded)  # trained, not the zero initialisation
    assert AutoTokenizer.from_pretrained(str(start)).chat_template
