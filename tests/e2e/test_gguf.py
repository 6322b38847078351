"""`ftkit export --gguf`, proven by llama.cpp itself (llama-cpp-python runs the files): on the demo run the
f16 file gives every greedy answer the merged Hugging Face model gives on the held-out questions, q8_0 at
least 98% of them; the chat template inside the file and the Modelfile's template (rendered by Go's
text/template, as Ollama does) both give the training prompt's tokens, BOS once where the family has one.
A tiny random Qwen2 and Llama model with their families' tokenizer layouts are converted the same way.

Skipped, saying so, where llama-cpp-python (make install-export) is not installed: it builds llama.cpp."""

from __future__ import annotations

import json

import pytest
from gguf_checks import (
    gguf_answers,
    gguf_prompt_ids,
    hf_answers,
    load_gguf,
    near_ties,
    ollama_prompt_ids,
    questions,
    training_prompt_ids,
)
from helpers import REPO, run_recipe
from tiny_gguf_families import FAMILY_PRE, go_renderer, tiny_gguf_family
from transformers import AutoTokenizer

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make install-export)")

from toolkit.commands import cli  # noqa: E402
from toolkit.errors import UserError  # noqa: E402
from toolkit.gguf import export, modelfile  # noqa: E402
from toolkit.gguf.tools import find_tools  # noqa: E402

try:
    TOOLS = find_tools(None)
except UserError as exc:
    pytest.skip(str(exc), allow_module_level=True)

EVAL = REPO / "toolkit" / "assets" / "demo" / "eval.jsonl"
STEPS = 300  # the demo's answers are right most of the time by then (exact match about 0.9)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo run, its merged model, and its f16, q8_0 and q4_k_m files."""
    root = tmp_path_factory.mktemp("gguf")
    run = root / "demo"
    run_recipe(run, f"train.max_steps={STEPS}", "eval.exact_match_samples=0")
    merged = root / "merged"
    checkpoint = run / "checkpoints" / f"step-{STEPS}"
    assert cli.main(["export", str(checkpoint), "--out", str(merged), "--merge-lora"]) == 0
    for quant in ("f16", "q8_0", "q4_k_m"):
        assert cli.main(["export", str(run), "--gguf", quant]) == 0
    return run, merged, root / "demo-gguf"


@pytest.fixture(scope="module")
def demo_answers(demo):
    _, merged, _ = demo
    tokenizer = AutoTokenizer.from_pretrained(str(merged))
    prompts = [training_prompt_ids(tokenizer, messages) for messages in questions(EVAL)]
    return prompts, hf_answers(merged, prompts), {tokenizer.eos_token_id}


def agreement(path, demo_answers) -> float:
    prompts, expected, eos = demo_answers
    got = gguf_answers(load_gguf(path), prompts, eos)
    return sum(g == e for g, e in zip(got, expected)) / len(expected)


def test_f16_gives_every_answer_of_the_merged_model(demo, demo_answers):
    assert agreement(demo[2] / "demo-f16.gguf", demo_answers) == 1.0


def test_q8_0_gives_at_least_98_percent_of_them(demo, demo_answers):
    assert agreement(demo[2] / "demo-q8_0.gguf", demo_answers) >= 0.98


def test_q4_k_m_figure(demo, demo_answers, capsys):
    share = agreement(demo[2] / "demo-q4_k_m.gguf", demo_answers)
    with capsys.disabled():
        print(f"\nq4_k_m: {share:.1%} of the merged model's greedy answers")
    assert share > 0.5


def test_the_files_template_and_the_modelfile_give_the_training_prompt(demo, go_render):
    _, merged, out = demo
    tokenizer = AutoTokenizer.from_pretrained(str(merged))
    llm = load_gguf(out / "demo-q8_0.gguf")
    template = modelfile.ollama_template(tokenizer)
    assert template in (out / "demo-q8_0.Modelfile").read_text()
    for messages in questions(EVAL)[:50]:
        expected = training_prompt_ids(tokenizer, messages)
        assert gguf_prompt_ids(llm, messages) == expected
        assert ollama_prompt_ids(llm, go_render(template, messages)) == expected


def test_an_existing_file_is_never_replaced(demo, capsys):
    run, _, out = demo
    before = (out / "demo-f16.gguf").stat()
    assert cli.main(["export", str(run), "--gguf", "f16"]) == 2
    assert "exists; ftkit never replaces it" in capsys.readouterr().err
    assert (out / "demo-f16.gguf").stat().st_mtime_ns == before.st_mtime_ns


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_a_tiny_family_model_converts_with_its_tokenizer(family, tmp_path, go_render):
    model_dir = tiny_gguf_family(tmp_path / family, family)
    work = tmp_path / "work"
    work.mkdir()
    path = export.convert_model(TOOLS, model_dir, work, "f16")
    llm = load_gguf(path)
    assert llm.metadata["tokenizer.ggml.pre"] == FAMILY_PRE[family]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text = "In 2025, 12345 apples cost $3.50 each; don't they?\n  Yes."
    assert (
        llm.tokenize(text.encode(), add_bos=False, special=False)
        == tokenizer(text, add_special_tokens=False)["input_ids"]
    )
    conversations = questions(EVAL)[:20]
    prompts = [training_prompt_ids(tokenizer, messages) for messages in conversations]
    bos = tokenizer.bos_token_id
    template = modelfile.ollama_template(tokenizer)
    for messages, expected in zip(conversations, prompts):
        assert gguf_prompt_ids(llm, messages) == expected
        assert ollama_prompt_ids(llm, go_render(template, messages)) == expected
        assert expected.count(bos) == (1 if family == "llama3" else 0)
    got, expected = gguf_answers(llm, prompts, {tokenizer.eos_token_id}), hf_answers(model_dir, prompts)
    # Random weights leave near ties that 16-bit rounding decides: answers may part only at one.
    gaps = near_ties(model_dir, prompts, got, expected)
    assert gaps is not None and all(gap < 1e-2 for gap in gaps), gaps
    assert sum(a == b for a, b in zip(got, expected)) >= 0.9 * len(prompts)


@pytest.fixture(scope="module")
def go_render(tmp_path_factory):
    return go_renderer(tmp_path_factory.mktemp("go"))


def test_too_little_disk_is_refused_before_anything_is_written(demo, tmp_path, monkeypatch, capsys):
    import collections

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(export.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    out = tmp_path / "small"
    assert cli.main(["export", str(demo[0]), "--gguf", "q8_0", "--out", str(out)]) == 2
    assert "GiB free; the merged model and its f16 file need about" in capsys.readouterr().err
    assert not out.exists()


def test_an_architecture_the_converter_does_not_know_is_named(tmp_path):
    model_dir = tiny_gguf_family(tmp_path / "model", "qwen2")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "architectures": ["TinyNewForCausalLM"]}))
    with pytest.raises(
        UserError, match="TinyNewForCausalLM is not an architecture .* it knows LlamaForCausalLM"
    ):
        export.convert_model(TOOLS, model_dir, tmp_path, "f16")
