"""A mistake in image data stops the SFT recipe with one line naming the file and row, exit 2, before any
checkpoint or model is written (the recipe runs in this process on the embedded tiny Llava)."""

import json

import pytest
from helpers import REPO, square_image

from toolkit.errors import run_main

pytestmark = pytest.mark.usefixtures("signal_handlers_restored")
LLAVA = REPO / "toolkit" / "assets" / "tiny-llava"
QUESTION = {"type": "text", "text": "What colour?"}


def trl_row(*refs: str) -> dict:
    user = {"role": "user", "content": [*({"type": "image"} for _ in refs), QUESTION]}
    return {"messages": [user, {"role": "assistant", "content": "red"}], "images": list(refs)}


def rows_file(tmp_path, bad: dict) -> str:
    """A good row, then `bad`, in `bad`'s layout (one layout a file)."""
    square_image(tmp_path / "ok.png", "red", side=32)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a picture")
    good = trl_row("ok.png")
    if "conversations" in bad:
        turns = [{"from": "human", "value": "<image>Which?"}, {"from": "gpt", "value": "red"}]
        good = {"conversations": turns, "images": ["ok.png"]}
    rows = [good, bad]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(tmp_path / "rows.jsonl")


SHAREGPT_TWO_PLACEHOLDERS = {
    "conversations": [{"from": "human", "value": "<image><image>Which?"}, {"from": "gpt", "value": "red"}],
    "images": ["ok.png"],
}
CASES = {
    "missing image": (LLAVA, trl_row("gone.png"), "rows.jsonl:2: image gone.png: file not found"),
    "corrupt image": (LLAVA, trl_row("broken.png"), "rows.jsonl:2: image "),
    "placeholders and images differ": (
        LLAVA,
        SHAREGPT_TWO_PLACEHOLDERS,
        "rows.jsonl:2: 2 image placeholder(s) but 1 image(s) given",
    ),
    "images for a text-only model": (
        REPO / "toolkit" / "assets" / "tiny-llama",
        trl_row("ok.png"),
        "rows.jsonl:1: this row has 1 image(s), but model.path is a text-only model",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_image_data_is_one_line(recipe, tmp_path, capsys, private_cache, case):
    model, bad, message = CASES[case]
    data = tmp_path / "data"
    data.mkdir()
    out = tmp_path / "run"
    if bad.get("conversations"):  # one layout a file: both rows in sharegpt's
        bad_file = rows_file(data, bad)
        first = {
            "conversations": [{"from": "human", "value": "<image>Which?"}, {"from": "gpt", "value": "red"}]
        }
        lines = [json.dumps({**first, "images": ["ok.png"]}), json.dumps(bad)]
        (data / "rows.jsonl").write_text("\n".join(lines) + "\n")
    else:
        bad_file = rows_file(data, bad)
    args = [f"output_dir={out}", f"model.path={model}", f"data.train={bad_file}", "data.eval=null"]
    code = run_main(recipe.main, [*args, "train.max_steps=1", "data.max_length=128"], "finetune_llm")
    captured = capsys.readouterr()
    assert code == 2, captured.err[-2000:]
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("finetune_llm: error: ") and message in lines[0], lines
    assert "Traceback" not in captured.err
    assert not (out / "final").exists() and not (out / "checkpoints").exists()
