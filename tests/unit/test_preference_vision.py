"""Image pairs on the embedded tiny Llava: the layouts' images read into the prompt, the prompt encoded
through the processor with only the completions scored, each pair's pixels given to both its rows (the
stacked batch scores each row as that row alone with its own image does), the reference tables computed
on the same pixels, a prompt never cut through its image, and a text-only model refusing image pairs."""

import json
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from helpers import REPO, square_image
from transformers import AutoModelForImageTextToText, AutoTokenizer

from toolkit.config import DataConfig, ModelConfig
from toolkit.data.vision_rows import as_parts
from toolkit.errors import UserError
from toolkit.model.vision import image_inputs
from toolkit.preference import reference
from toolkit.preference.data import PairCollator, build_pairs, render_pair
from toolkit.preference.loss import batch_sequence_logps, sequence_logps
from toolkit.preference.records import detect_layout, to_pair
from toolkit.train.loss import IGNORE

LLAVA = REPO / "toolkit" / "assets" / "tiny-llava"
QUESTION = [{"type": "image"}, {"type": "text", "text": "What colour?"}]
ANSWER = {"role": "assistant", "content": "blue"}


def trl_pair(ref: str, right: str, wrong: str) -> dict:
    return {
        "prompt": [{"role": "user", "content": QUESTION}],
        "chosen": [{"role": "assistant", "content": right}],
        "rejected": [{"role": "assistant", "content": wrong}],
        "images": [ref],
    }


def jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def inputs():
    return image_inputs(ModelConfig(path=str(LLAVA)), None)


@pytest.fixture(scope="module")
def model():
    return AutoModelForImageTextToText.from_pretrained(LLAVA).eval()


@pytest.fixture
def colours(tmp_path) -> Path:
    for colour in ("red", "blue"):
        square_image(tmp_path / "img" / f"{colour}.png", colour, side=32)
    return tmp_path


def pair_of(record: dict):
    return to_pair(record, detect_layout(record, "f:1"), "f:1")


def test_layouts_give_the_same_image_pair():
    expected = pair_of(trl_pair("a.png", "red", "blue"))
    assert expected.images == ["a.png"] and expected.prompt[0]["content"][0] == {"type": "image"}
    own_source = {**trl_pair("x", "red", "blue"), "images": None}
    own_source["prompt"] = [{"role": "user", "content": [{"type": "image", "image": "a.png"}, QUESTION[1]]}]
    repeated = {**trl_pair("a.png", "red", "blue")}
    repeated["chosen"] = repeated["prompt"] + repeated["chosen"]
    implicit = {"chosen": repeated["chosen"], "rejected": repeated["prompt"] + repeated["rejected"]}
    implicit["images"] = ["a.png"]
    for record in (own_source, repeated, implicit):
        assert pair_of(record) == expected
    ranking = {
        "conversations": [{"from": "human", "value": "<image>What colour?"}],
        "chosen": {"from": "gpt", "value": "red"},
        "rejected": {"from": "gpt", "value": "blue"},
        "images": ["a.png"],
    }
    assert pair_of(ranking) == expected


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"images": []}, "f:1: 1 image placeholder(s) but 0 image(s) given"),
        ({"images": ["a.png", "b.png"]}, "f:1: 1 image placeholder(s) but 2 image(s) given"),
        (
            {"rejected": [ANSWER, {"role": "user", "content": QUESTION}, ANSWER]},
            "f:1: 'rejected' holds an image after the prompt; put the images in the prompt",
        ),
        (
            {"chosen": [{"role": "assistant", "content": QUESTION}]},
            "f:1: chosen[0]: images in an assistant turn are not trained",
        ),
    ],
)
def test_misplaced_images_are_one_line(change, message):
    with pytest.raises(UserError) as caught:
        pair_of({**trl_pair("a.png", "red", "blue"), **change})
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_text_model_refuses_image_pairs_naming_the_line(colours):
    path = jsonl(
        colours / "p.jsonl",
        [{"prompt": "q", "chosen": "a", "rejected": "b"}, trl_pair("img/red.png", "red", "blue")],
    )
    tokenizer = AutoTokenizer.from_pretrained(REPO / "toolkit" / "assets" / "tiny-llama")
    with pytest.raises(UserError) as caught:
        build_pairs(DataConfig(train=path, eval_fraction=0), tokenizer, 32, seed=0)
    assert str(caught.value) == (
        f"{path}:2: this pair has 1 image(s), but model.path is a text-only model; "
        "use a vision-language model or leave the images out"
    )


def test_prompt_and_image_tokens_are_never_scored(colours, inputs):
    records = [
        trl_pair("img/red.png", "red", "blue"),
        {"prompt": "Say ok.", "chosen": "ok", "rejected": "no"},
    ]
    path = jsonl(colours / "p.jsonl", records)
    tokenizer = inputs.processor.tokenizer
    train, _, _ = build_pairs(DataConfig(train=path, eval_fraction=0), tokenizer, 64, 0, images=inputs)
    assert train["images"] == [[str(colours / "img" / "red.png")], []]
    batch = PairCollator(tokenizer.pad_token_id, inputs)([train[0], train[1]])
    scored = [
        tokenizer.decode(ids[labels != IGNORE]) for ids, labels in zip(batch["input_ids"], batch["labels"])
    ]
    assert scored == ["red<|im_end|>", "ok<|im_end|>", "blue<|im_end|>", "no<|im_end|>"]
    image_tokens = batch["input_ids"] == inputs.image_id
    assert image_tokens.sum(1).tolist() == [16, 0, 16, 0]  # the image pair's two rows, its image expanded
    assert (batch["labels"][image_tokens] == IGNORE).all()
    assert batch["pixel_values"].shape[0] == 2  # the one image, once for each of its rows
    # Each row is the whole conversation as the processor encodes it with the row's image.
    pair = pair_of(records[0])
    sides = {
        "prompt": as_parts(pair.prompt),
        "chosen": as_parts(pair.chosen),
        "rejected": as_parts(pair.rejected),
    }
    prompt, chosen, rejected = render_pair(tokenizer, type(pair)(**sides, images=pair.images), "f:1")
    image = inputs.open(train[0]["images"], "f:1")
    for row, completion in ((0, chosen), (2, rejected)):
        whole = inputs.expanded_ids(prompt + completion, image)
        assert batch["input_ids"][row, : len(whole)].tolist() == whole


def test_each_row_is_scored_with_its_own_pair_s_image(colours, inputs, model):
    records = [trl_pair("img/red.png", "red", "blue"), trl_pair("img/blue.png", "blue", "red")]
    path = jsonl(colours / "p.jsonl", records)
    tokenizer = inputs.processor.tokenizer
    train, _, _ = build_pairs(DataConfig(train=path, eval_fraction=0), tokenizer, 64, 0, images=inputs)
    rows = [{**train[i], "pair_index": i} for i in range(2)]
    collate = PairCollator(tokenizer.pad_token_id, inputs)
    with torch.no_grad():
        stacked = batch_sequence_logps(model, collate(rows))[0]
        alone = []
        for side in ("chosen_ids", "rejected_ids"):
            for row in rows:
                ids = torch.tensor([row["prompt_ids"] + row[side]])
                labels = torch.tensor([[IGNORE] * len(row["prompt_ids"]) + row[side]])
                pixels = inputs.pixels([inputs.open(row["images"], "f:1")])
                alone.append(sequence_logps(model(input_ids=ids, **pixels).logits, labels)[0])
    torch.testing.assert_close(stacked, torch.cat(alone), rtol=1e-5, atol=1e-5)
    # The colours matter to the model: the same rows with the images swapped score differently.
    swapped = [{**rows[0], "images": rows[1]["images"]}, {**rows[1], "images": rows[0]["images"]}]
    with torch.no_grad():
        assert not torch.allclose(batch_sequence_logps(model, collate(swapped))[0], stacked, atol=1e-4)
    table = reference.compute(Accelerator(cpu=True), model, rows, collate, batch_size=1)
    torch.testing.assert_close(
        torch.cat([table.chosen, table.rejected]).float(), stacked, rtol=1e-5, atol=1e-5
    )


def test_a_prompt_is_never_cut_through_its_image(colours, inputs):
    long_answer = " ".join(["red"] * 40)
    records = [
        trl_pair("img/red.png", "red", "blue"),
        trl_pair("img/red.png", long_answer, "blue"),  # the answer is cut; the prompt fits its budget
        {"prompt": "Say ok. " * 20, "chosen": "ok", "rejected": "no"},  # a text prompt is cut from the left
    ]
    path = jsonl(colours / "p.jsonl", records)
    tokenizer = inputs.processor.tokenizer
    cfg = DataConfig(train=path, eval_fraction=0, max_length=48)
    train, _, stats = build_pairs(cfg, tokenizer, 32, 0, images=inputs)
    assert (len(train), stats.truncated, stats.dropped) == (3, 2, 0)
    assert all(len(p) + len(c) <= 48 for p, c in zip(train["prompt_ids"], train["chosen_ids"]))
    # With a budget smaller than the image prompt, the long pair goes whole rather than through its image.
    train, _, stats = build_pairs(cfg, tokenizer, 16, 0, images=inputs)
    assert (len(train), stats.truncated, stats.dropped) == (2, 1, 1)
    assert [ids.count(inputs.image_id) for ids in train["prompt_ids"]] == [16, 0]
