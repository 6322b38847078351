"""Images in the data layouts: each layout's records normalised to messages with image parts plus the
row's image references, the mistakes refused in one line, and references resolved and opened (images are
written here with PIL, none are shipped)."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
from PIL import Image

from toolkit.data.formats import detect_format, to_example
from toolkit.data.images import open_image, resolve_image
from toolkit.data.sources import read_source
from toolkit.errors import UserError

IMAGE = {"type": "image"}
ANSWER = {"role": "assistant", "content": "A cat."}
ANSWER_GPT = {"from": "gpt", "value": "A cat."}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def example(record: dict) -> dict:
    return to_example(record, detect_format(record, "f:1"), "f:1")


def png(path: Path, size: tuple[int, int] = (8, 4), mode: str = "RGB") -> Path:
    Image.new(mode, size, color=(200, 10, 10, 255)[: len(mode)]).save(path)
    return path


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def records_of(path: Path) -> list[tuple[dict, str]]:
    """(record, where) for each record of a data file, named the way the encoder names them."""
    return [
        (record, chunk.where(i))
        for chunk in read_source(str(path), "train").read(100)
        for i, record in enumerate(chunk.records())
    ]


# --- layouts -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image", "image": "a.png"},
        {"type": "image", "url": "a.png"},
        {"type": "image", "path": "a.png"},
        {"type": "image", "image": "a.png", "url": None, "text": None},
        {"type": "image_url", "image_url": {"url": "a.png"}},
        {"type": "image_url", "image_url": "a.png"},
    ],
    ids=["image", "url", "path", "hf-nulls", "openai", "openai-string"],
)
def test_content_parts_with_their_own_source(part):
    record = {"messages": [{"role": "user", "content": [text("What is "), part, text("?")]}, ANSWER]}
    assert example(record) == {
        "messages": [{"role": "user", "content": [text("What is "), IMAGE, text("?")]}, ANSWER],
        "tools": None,
        "images": ["a.png"],
    }


@pytest.mark.parametrize("images", [["a.png"], "a.png"], ids=["list", "one-string"])
def test_trl_bare_parts_take_the_images_column(images):
    record = {"messages": [{"role": "user", "content": [IMAGE, text("Describe.")]}, ANSWER], "images": images}
    assert example(record) == {
        "messages": [{"role": "user", "content": [IMAGE, text("Describe.")]}, ANSWER],
        "tools": None,
        "images": ["a.png"],
    }


def test_llamafactory_placeholders_split_the_text_over_several_images():
    record = {
        "conversations": [
            {"from": "human", "value": "<image><image>Which is larger?"},
            {"from": "gpt", "value": "The first."},
            {"from": "human", "value": "And <image>?"},
            {"from": "gpt", "value": "Smaller."},
        ],
        "images": ["one.png", "two.png", "three.png"],
    }
    assert example(record) == {
        "messages": [
            {"role": "user", "content": [IMAGE, IMAGE, text("Which is larger?")]},
            {"role": "assistant", "content": "The first."},
            {"role": "user", "content": [text("And "), IMAGE, text("?")]},
            {"role": "assistant", "content": "Smaller."},
        ],
        "tools": None,
        "images": ["one.png", "two.png", "three.png"],
    }


@pytest.mark.parametrize("image", ["coco/1.jpg", ["coco/1.jpg"]], ids=["string", "list"])
def test_llava_image_field(image):
    record = {
        "id": "000001",
        "image": image,
        "conversations": [
            {"from": "human", "value": "<image>\nWhat is on the table?"},
            {"from": "gpt", "value": "A cup."},
        ],
    }
    assert example(record) == {
        "messages": [
            {"role": "user", "content": [IMAGE, text("\nWhat is on the table?")]},
            {"role": "assistant", "content": "A cup."},
        ],
        "tools": None,
        "images": ["coco/1.jpg"],
    }


def test_placeholders_in_messages_text_with_images_column():
    record = {"messages": [{"role": "user", "content": "<image>Describe."}, ANSWER], "images": ["a.png"]}
    assert example(record)["messages"][0] == {"role": "user", "content": [IMAGE, text("Describe.")]}
    assert example(record)["images"] == ["a.png"]


def test_own_sources_and_column_fill_the_parts_in_order():
    content = [IMAGE, {"type": "image", "image": "inline.png"}, IMAGE, text("Compare.")]
    record = {
        "messages": [{"role": "user", "content": content}, ANSWER],
        "images": ["first.png", "third.png"],
    }
    assert example(record)["images"] == ["first.png", "inline.png", "third.png"]


def test_text_rows_read_as_before_with_no_images(tmp_path):
    """Text-only rows mixed among image rows give what they gave before plus `images: []`; `<image>` in a
    row without an image column is text, kept as written."""
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"conversations": [{"from": "human", "value": "<image>Hi"}, ANSWER_GPT], "image": "cat.png"},
            {"conversations": [{"from": "human", "value": "Hi"}, ANSWER_GPT]},
            {"conversations": [{"from": "human", "value": "What does <image> draw?"}, ANSWER_GPT]},
            {
                "messages": [{"role": "user", "content": [text("an "), text("<image> tag")]}, ANSWER],
                "system": "S",
            },
        ],
    )
    examples = [to_example(r, detect_format(r, where), where) for r, where in records_of(path)]
    assert examples[0]["images"] == ["cat.png"]
    assert examples[1:] == [
        {"messages": [{"role": "user", "content": "Hi"}, ANSWER], "tools": None, "images": []},
        {
            "messages": [{"role": "user", "content": "What does <image> draw?"}, ANSWER],
            "tools": None,
            "images": [],
        },
        {
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "an <image> tag"},
                ANSWER,
            ],
            "tools": None,
            "images": [],
        },
    ]
    alpaca = to_example({"instruction": "a", "output": "A cat."}, "alpaca", "f:1")
    assert alpaca == {"messages": [{"role": "user", "content": "a"}, ANSWER], "tools": None, "images": []}


# --- mistakes ----------------------------------------------------------------------------------------


def test_count_mismatch_names_the_file_and_line(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "Hi"}, ANSWER]},
        {
            "conversations": [{"from": "human", "value": "<image><image>?"}, {"from": "gpt", "value": "No"}],
            "images": ["a.png"],
        },
    ]
    path = write_jsonl(tmp_path / "count.jsonl", rows)
    (first, _), (second, where) = records_of(path)
    assert to_example(first, "messages", "x")["images"] == []
    with pytest.raises(UserError) as caught:
        to_example(second, "sharegpt", where)
    assert str(caught.value) == f"{path}:2: 2 image placeholder(s) but 1 image(s) given"


def test_a_column_repeating_the_parts_own_images_is_refused():
    record = {
        "messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}, ANSWER],
        "images": ["a.png"],
    }
    with pytest.raises(UserError, match=r"^f:1: 1 image placeholder\(s\) but 2 image\(s\) given \(1 in the "):
        example(record)


@pytest.mark.parametrize(
    ("record", "error"),
    [
        (
            {
                "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [IMAGE]}],
                "images": ["a.png"],
            },
            "f:1: messages[1]: images in an assistant turn are not trained; put them in a user turn",
        ),
        (
            {"conversations": [{"from": "gpt", "value": "<image>"}], "images": ["a.png"]},
            "f:1: conversations[0]: images in an assistant turn are not trained; put them in a user turn",
        ),
        (
            {"messages": [{"role": "user", "content": [IMAGE]}]},
            "f:1: 1 image placeholder(s) but 0 image(s) given",
        ),
        (
            {"messages": [{"role": "user", "content": [IMAGE]}], "images": [3]},
            "f:1: field 'images'[0] must be an image path, got int",
        ),
        (
            {"messages": [{"role": "user", "content": [IMAGE]}], "images": {"a": 1}},
            "f:1: field 'images' must be a list of image paths, got dict",
        ),
        (
            {"messages": [{"role": "user", "content": [IMAGE]}], "images": ["a.png"], "image": "b.png"},
            "f:1: fields 'images' and 'image' both list images; give one",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "image": {"bytes": b""}}]}]},
            "f:1: messages[0]: field 'content'[0].image must be an image path or URL, got dict",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}]},
            "f:1: messages[0]: field 'content'[0].image_url must be an image path or URL, got int",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "f:1: messages[0]: field 'content'[0] is an 'image_url' part without its 'image_url' "
            "{'url': ...}",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "image": "a", "url": "b"}]}]},
            "f:1: messages[0]: field 'content'[0] gives its image twice (image, url); give one",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "f:1: messages[0]: field 'content'[0] is a 'input_audio' part; "
            "only text and image parts are read",
        ),
        (
            {"messages": [{"role": "user", "content": ["hi"]}]},
            "f:1: messages[0]: field 'content'[0] must be a content part object, got str",
        ),
        (
            {"instruction": "a", "output": "b", "images": ["a.png"]},
            "f:1: field 'images' is read with the messages and conversations layouts, not data.format alpaca",
        ),
    ],
    ids=[
        "assistant-part",
        "assistant-placeholder",
        "no-images",
        "not-strings",
        "not-a-list",
        "two-columns",
        "source-type",
        "url-type",
        "image-url-without-url",
        "two-sources",
        "unknown-part",
        "part-not-object",
        "alpaca-images",
    ],
)
def test_mistakes_are_one_line_naming_the_row_and_field(record, error):
    with pytest.raises(UserError) as caught:
        example(record)
    assert str(caught.value) == error


# --- resolve_image -----------------------------------------------------------------------------------


def test_relative_paths_start_from_the_data_folder(tmp_path, monkeypatch):
    (tmp_path / "imgs").mkdir()
    image = png(tmp_path / "imgs" / "a.png")
    assert resolve_image("imgs/a.png", tmp_path, "f:1") == str(image)
    assert resolve_image("imgs/../imgs/a.png", tmp_path, "f:1") == str(image)
    monkeypatch.chdir(tmp_path / "imgs")
    assert resolve_image("a.png", None, "f:1") == str(image)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_image("~/imgs/a.png", Path("/elsewhere"), "f:1") == str(image)
    assert resolve_image(str(image), Path("/elsewhere"), "f:1") == str(image)


def test_file_urls_become_paths(tmp_path):
    image = png(tmp_path / "a b.png")
    assert resolve_image(image.as_uri(), None, "f:1") == str(image)
    assert resolve_image(f"file://localhost{image}", None, "f:1") == str(image)


def test_data_urls_are_kept(tmp_path):
    url = data_url(png(tmp_path / "a.png"))
    assert resolve_image(url, tmp_path, "f:1") == url


@pytest.mark.parametrize(
    ("ref", "error"),
    [
        (
            "https://example.com/a.png",
            "f:1: image https://example.com/a.png: remote images are not downloaded during training; "
            "fetch them and give the local path",
        ),
        (
            "s3://bucket/a.png",
            "f:1: image s3://bucket/a.png: remote images are not downloaded during training",
        ),
        (
            "data:text/plain;base64,aGk=",
            "f:1: image data:text/plain;base64,aGk=: a data URL must read data:image/",
        ),
        (
            "file://host/a.png",
            "f:1: image file://host/a.png: a file URL must not name a host; write file:///",
        ),
    ],
    ids=["http", "s3", "data-not-image", "file-url-host"],
)
def test_references_refused(ref, error):
    with pytest.raises(UserError) as caught:
        resolve_image(ref, None, "f:1")
    assert str(caught.value).startswith(error)


def test_missing_file_names_where_it_was_looked_for(tmp_path):
    with pytest.raises(UserError) as caught:
        resolve_image("imgs/none.png", tmp_path, "data.jsonl:3")
    assert (
        str(caught.value) == f"data.jsonl:3: image imgs/none.png: file not found ({tmp_path}/imgs/none.png)"
    )


# --- open_image --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_opens_paths_and_data_urls_as_rgb(tmp_path, mode):
    image = png(tmp_path / "a.png", (8, 4), mode)
    for ref in (str(image), data_url(image)):
        opened = open_image(ref, "f:1")
        assert (opened.mode, opened.size) == ("RGB", (8, 4))


def test_corrupt_file_is_one_line_naming_it(tmp_path):
    bad = tmp_path / "x.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)
    with pytest.raises(UserError) as caught:
        open_image(str(bad), "f:4")
    message = str(caught.value)
    assert message.startswith(f"f:4: image {bad}: not a readable PNG, JPEG") and "\n" not in message


def test_truncated_file_fails_at_open_not_later(tmp_path):
    whole = png(tmp_path / "whole.png", (64, 64)).read_bytes()
    cut = tmp_path / "cut.png"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UserError, match=f"^f:1: image {re.escape(str(cut))}: not a readable"):
        open_image(str(cut), "f:1")


def test_formats_that_can_run_programs_are_not_opened(tmp_path):
    """PIL opens EPS through Ghostscript; only plain raster formats are read (PPM stands in for the rest)."""
    other = tmp_path / "a.ppm"
    Image.new("RGB", (4, 4)).save(other)
    with pytest.raises(UserError, match="not a readable PNG, JPEG, WEBP, GIF, BMP, TIFF image"):
        open_image(str(other), "f:1")


def test_bad_base64_is_refused():
    """Strictly: a lenient decoder would skip the stray character and hand PIL six bytes of "hello!"."""
    with pytest.raises(UserError) as caught:
        open_image("data:image/png;base64,aGVsbG8h!", "f:2")
    assert str(caught.value).startswith(
        "f:2: image data:image/png;base64,aGVsbG8h!: the base64 data is invalid"
    )


@pytest.mark.parametrize(
    ("size", "max_pixels", "expected"),
    [
        ((400, 200), 5000, (100, 50)),
        ((401, 199), 5000, (100, 49)),
        ((1000, 1), 10, (10, 1)),
        ((1, 1000), 10, (1, 10)),
    ],
    ids=["2-to-1", "odd", "wide-strip", "tall-strip"],
)
def test_max_pixels_scales_down_keeping_the_aspect(tmp_path, size, max_pixels, expected):
    opened = open_image(str(png(tmp_path / "a.png", size)), "f:1", max_pixels=max_pixels)
    width, height = opened.size
    assert opened.size == expected and width * height <= max_pixels
    if min(size) > 1:
        assert abs(width / height - size[0] / size[1]) < 0.05


def test_small_images_are_not_scaled(tmp_path):
    assert open_image(str(png(tmp_path / "a.png", (40, 20))), "f:1", max_pixels=5000).size == (40, 20)
