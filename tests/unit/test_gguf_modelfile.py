"""The Modelfile's TEMPLATE renders, with Go's text/template as Ollama does, the same text as the training
chat template of each family ftkit writes one for (the BOS the training template writes is Ollama's to add:
the GGUF file says so), and the refusals of `ftkit export --gguf` that need no converter."""

from __future__ import annotations

import pytest
from helpers import REPO
from tiny_gguf_families import GEMMA3, LLAMA3, QWEN3, QWEN25, go_renderer
from transformers import AutoTokenizer

from toolkit.commands import cli
from toolkit.gguf import convert, modelfile

DEMO_TOKENIZER = REPO / "toolkit" / "assets" / "tiny-llama"
# name -> (training template, its BOS text, its end-of-turn token)
FAMILIES = {
    "demo": (None, None, "<|im_end|>"),
    "qwen2.5": (QWEN25, None, "<|im_end|>"),
    "qwen3": (QWEN3, None, "<|im_end|>"),
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    "gemma3": (GEMMA3, "<bos>", "<end_of_turn>"),
}
SYSTEM = {"role": "system", "content": "You are a calculator."}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [SYSTEM, {"role": "user", "content": "Add 3 and 4."}],
    [
        SYSTEM,
        {"role": "user", "content": "Add 3 and 4."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "And 5 more?"},
    ],
    [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Times 3?"},
    ],
]


@pytest.fixture(scope="module")
def go_render(tmp_path_factory):
    return go_renderer(tmp_path_factory.mktemp("go"))


def family_tokenizer(name: str):
    template, bos, turn_end = FAMILIES[name]
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER))
    tokens = [t for t in (bos, turn_end) if t and t not in tokenizer.get_vocab()]
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    if template:
        tokenizer.chat_template = template
    if bos:
        tokenizer.bos_token = bos
    return tokenizer


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_modelfile_template_renders_the_training_prompt(name, go_render):
    tokenizer = family_tokenizer(name)
    template = modelfile.ollama_template(tokenizer)
    assert template is not None
    bos = FAMILIES[name][1] or ""
    for messages in CONVERSATIONS:
        training = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert training.startswith(bos)
        assert go_render(template, messages) == training[len(bos) :], (name, messages)


def test_demo_modelfile_is_as_written(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER))
    stops = modelfile.stop_tokens(DEMO_TOKENIZER, tokenizer)
    text = modelfile.modelfile("demo-q8_0.gguf", modelfile.ollama_template(tokenizer), stops, 64)
    assert text == (
        "FROM ./demo-q8_0.gguf\n"
        'TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}\n'
        "{{ .Content }}<|im_end|>\n"
        "{{ end }}<|im_start|>assistant\n"
        '"""\n'
        'PARAMETER stop "<|endoftext|>"\n'
        'PARAMETER stop "<|im_end|>"\n'
        "PARAMETER num_ctx 64\n"
    )


def test_a_template_of_another_family_is_left_to_the_gguf_file():
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER))
    tokenizer.chat_template = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    assert modelfile.ollama_template(tokenizer) is None
    assert "TEMPLATE" not in modelfile.modelfile("x.gguf", None, ["</s>"], 64)


def test_the_demo_tokenizer_is_identified_by_its_split_pattern():
    assert convert.split_pattern_name(DEMO_TOKENIZER) == "qwen2"


def test_bad_requests_are_one_line_and_exit_2(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    assert cli.main(["export", str(run), "--gguf", "q3_k"]) == 2
    assert "unknown type 'q3_k'" in capsys.readouterr().err
    assert cli.main(["export", str(run), "--gguf", "q8_0", "--llama-cpp", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "has no convert_hf_to_gguf.py" in err or "no complete checkpoint" in err
    out = tmp_path / "out"
    out.mkdir()
    (out / "run-q8_0.gguf").write_text("someone's file")
    assert cli.main(["export", str(run), "--gguf", "q8_0", "--out", str(out)]) == 2
    assert "exists; ftkit never replaces it" in capsys.readouterr().err
    assert (out / "run-q8_0.gguf").read_text() == "someone's file"


def test_without_llama_cpp_one_line_says_what_to_install(monkeypatch, tmp_path):
    from toolkit.errors import UserError
    from toolkit.gguf import tools

    monkeypatch.setattr(tools, "_installed_version", lambda: None)
    with pytest.raises(UserError, match="llama.cpp is not installed here; run make install-export"):
        tools.find_tools(None)
    monkeypatch.setattr(tools, "_installed_version", lambda: "0.0.1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(UserError, match="its converter is not in"):
        tools.find_tools(None)


def test_an_export_without_out_or_gguf_is_refused(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path)]) == 2
    assert "--out: required" in capsys.readouterr().err


def test_a_vision_language_base_is_refused_before_anything_is_written(tmp_path):
    from toolkit.errors import UserError
    from toolkit.gguf import export

    with pytest.raises(UserError, match="vision-language run; .* export it with --merge-lora instead"):
        export._check_base(REPO / "toolkit" / "assets" / "tiny-llava", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    export._check_base(DEMO_TOKENIZER, tmp_path / "out")  # the demo's base: a text model, and it fits
