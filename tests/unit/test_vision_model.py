"""Vision-language models in process: which parts train by key, the encoded rows' labels (image tokens and
prompts never trained), the collator's pixels and stand-in image, and the one-line refusals."""

import json

import pytest
import torch
from helpers import square_image, tiny_qwen_vl

from toolkit.config import LoraConfig, ModelConfig, VisionConfig
from toolkit.data.encode import IGNORE, ChunkEncoder
from toolkit.data.sources import read_source
from toolkit.data.vision_rows import VisionCollator, VisionEncoder, carry_labels
from toolkit.errors import UserError
from toolkit.model import vision
from toolkit.model.load import load_model


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return tiny_qwen_vl(tmp_path_factory.mktemp("qwen") / "model")


@pytest.fixture(scope="module")
def inputs(qwen):
    return vision.image_inputs(ModelConfig(path=str(qwen)), None)


def trained(model) -> dict[str, int]:
    return {part: counts[0] for part, counts in vision.trained_by_part(model).items()}


def test_parts_train_by_key(qwen):
    lora = load_model(ModelConfig(path=str(qwen)), LoraConfig(), parts=VisionConfig())
    assert trained(lora)["tower"] == 0 and trained(lora)["projector"] == 0
    assert trained(lora)["language model"] > 0
    assert "vision: qwen2_5_vl; tower frozen" in vision.parts_line(lora)

    both = load_model(
        ModelConfig(path=str(qwen)),
        LoraConfig(),
        parts=VisionConfig(train_projector=True, train_tower=True, tower_blocks=1),
    )
    adapted = {n for n, p in both.named_parameters() if p.requires_grad and vision.part_of(n) == "tower"}
    assert adapted and all(".blocks.1." in name and "lora_" in name for name in adapted)
    assert trained(both)["projector"] == trained(both)["projector"] > 0

    full = load_model(ModelConfig(path=str(qwen), method="full"), LoraConfig(), parts=VisionConfig())
    counts = vision.trained_by_part(full)
    assert counts["tower"][0] == 0 and counts["projector"][0] == 0
    assert counts["language model"][0] == counts["language model"][1]

    with pytest.raises(UserError, match="vision.tower_blocks: 5, but the tower has 2 blocks"):
        load_model(
            ModelConfig(path=str(qwen), method="full"),
            LoraConfig(),
            parts=VisionConfig(train_tower=True, tower_blocks=5),
        )


def test_part_names_across_families():
    assert vision.part_of("base_model.model.model.visual.blocks.0.attn.qkv.weight") == "tower"
    assert vision.part_of("model.visual.merger.mlp.0.weight") == "projector"
    assert vision.part_of("model.vision_tower.vision_model.encoder.layers.1.mlp.fc1.weight") == "tower"
    assert vision.part_of("model.multi_modal_projector.linear_1.weight") == "projector"
    assert vision.part_of("model.connector.modality_projection.proj.weight") == "projector"
    assert vision.part_of("model.image_newline") == "projector"
    assert vision.part_of("model.language_model.layers.0.self_attn.q_proj.weight") == "language model"
    assert vision.part_of("lm_head.weight") == "language model"


def write_rows(tmp_path, rows) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def image_row(ref: str, answer: str = "red") -> dict:
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}
    return {"messages": [user, {"role": "assistant", "content": answer}], "images": [ref]}


def encode(inputs, path: str, max_length: int = 256):
    encoder = VisionEncoder("messages", inputs.processor.tokenizer, max_length, True, True, inputs)
    return encoder(next(read_source(path, "train").read(100)))


def test_only_the_answer_is_trained(inputs, tmp_path):
    square_image(tmp_path / "img" / "a.png", "red")
    columns, counts = encode(inputs, write_rows(tmp_path, [image_row("img/a.png")]))
    ids, labels = columns["input_ids"][0], columns["labels"][0]
    tokenizer = inputs.processor.tokenizer
    assert ids.count(inputs.image_id) == 4  # a 56 x 56 image: 4 x 4 patches merged 2 x 2
    trained = [token for token, label in zip(ids, labels) if label != IGNORE]
    assert tokenizer.decode(trained) == "red<|im_end|>"
    assert all(label == IGNORE for token, label in zip(ids, labels) if token == inputs.image_id)
    assert columns["images"] == [[str((tmp_path / "img" / "a.png").resolve())]]
    assert counts == {"truncated": 0, "dropped": 0}


def test_rows_too_long_with_their_images_are_dropped(inputs, tmp_path):
    from PIL import Image

    Image.new("RGB", (112, 112)).save(tmp_path / "big.png")  # 16 image tokens
    square_image(tmp_path / "small.png", "red")
    path = write_rows(tmp_path, [image_row("big.png"), image_row("small.png")])
    columns, counts = encode(inputs, path, max_length=30)  # 37 and 25 tokens once expanded
    assert counts["dropped"] == 1 and [len(ids) for ids in columns["input_ids"]] == [25]


def test_carry_labels_refuses_changed_answers():
    ids, labels = [1, 2, 9, 3, 4], [IGNORE, IGNORE, IGNORE, 3, 4]
    assert carry_labels(ids, labels, [1, 2, 9, 9, 9, 3, 4], "x") == [IGNORE] * 5 + [3, 4]
    with pytest.raises(UserError, match="x: expanding the images changed the tokens of an assistant turn"):
        carry_labels(ids, labels, [1, 2, 9, 9, 3, 5], "x")


def test_collator_gives_pixels_and_a_masked_stand_in(inputs, tmp_path):
    square_image(tmp_path / "a.png", "red")
    path = write_rows(tmp_path, [image_row("a.png")])
    columns, _ = encode(inputs, path)
    row = {key: values[0] for key, values in columns.items()}
    collate = VisionCollator(inputs.processor.tokenizer.pad_token_id, inputs)
    batch = collate([row, row])
    assert batch["pixel_values"].shape[0] == 2 * 16  # 16 patches per image
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
    assert torch.equal(batch["mm_token_type_ids"], (batch["input_ids"] == inputs.image_id).long())

    text = {"input_ids": row["input_ids"][:5], "labels": [IGNORE] * 4 + [7], "images": []}
    lone = collate([text])
    assert "pixel_values" in lone, "a batch without images still runs the tower"
    assert lone["attention_mask"][0, :5].tolist() == [1] * 5
    assert lone["attention_mask"][0, 5:].sum() == 0 and (lone["labels"][0, 5:] == IGNORE).all()
    assert (lone["input_ids"][0] == inputs.image_id).sum() == 4


def test_images_for_a_text_model_are_one_line(tmp_path):
    from helpers import REPO
    from transformers import AutoTokenizer

    square_image(tmp_path / "a.png", "red")
    path = write_rows(tmp_path, [image_row("a.png")])
    tokenizer = AutoTokenizer.from_pretrained(REPO / "toolkit" / "assets" / "tiny-llama")
    encoder = ChunkEncoder("messages", tokenizer, 64, True)
    with pytest.raises(
        UserError, match=r"rows.jsonl:1: this row has 1 image\(s\), but model.path is a text-only"
    ):
        encoder(next(read_source(path, "train").read(100)))


def test_unproven_family_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "paligemma"}))
    with pytest.raises(UserError, match="paligemma is a vision-language family ftkit does not train yet"):
        vision.image_inputs(ModelConfig(path=str(tmp_path)), None)
