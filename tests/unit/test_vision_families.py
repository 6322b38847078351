"""Gemma-3 and Idefics3 (SmolVLM's architecture) in process, each a tiny random model saved with its
processor: recognised from the folder alone, LoRA on the language model only, rows in TRL's layout trained
on their answers only, the collator's pixel inputs, and one forward and backward (also on a batch of text
rows, which gets the masked stand-in image)."""

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import square_image, tiny_gemma3, tiny_idefics3
from transformers import AutoModelForImageTextToText

from toolkit.config import LoraConfig, ModelConfig, VisionConfig
from toolkit.data.collate import Collator
from toolkit.data.encode import IGNORE
from toolkit.data.formats import detect_format
from toolkit.data.sources import read_source
from toolkit.data.vision_rows import VisionCollator, VisionEncoder
from toolkit.model import vision
from toolkit.model.load import load_model, model_class
from toolkit.train.loss import batch_loss, batch_targets

# What each family must show: its classes, the end of an assistant turn, and how many image tokens one
# 56-pixel image becomes (Gemma-3: 4 pooled soft tokens; Idefics3: 4 crops and a global one, 4 tokens each).
EXPECTED = {
    "gemma3": dict(
        build=tiny_gemma3,
        architecture="Gemma3ForConditionalGeneration",
        processor="Gemma3Processor",
        images="Gemma3ImageProcessorPil",
        end="<end_of_turn>",
        per_image=4,
    ),
    "idefics3": dict(
        build=tiny_idefics3,
        architecture="Idefics3ForConditionalGeneration",
        processor="Idefics3Processor",
        images="Idefics3ImageProcessorPil",
        end="<end_of_utterance>",
        per_image=20,
    ),
}


def user(images: int, text: str) -> dict:
    return {
        "role": "user",
        "content": [*({"type": "image"} for _ in range(images)), {"type": "text", "text": text}],
    }


ROWS = [
    {"messages": [user(1, "What colour?"), {"role": "assistant", "content": "red"}], "images": ["red.png"]},
    {
        "messages": [user(2, "Which colours?"), {"role": "assistant", "content": "red and blue"}],
        "images": ["red.png", "blue.png"],
    },
    {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]},
]
ANSWERS = ["red", "red and blue", "hi"]


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def family(request, tmp_path_factory):
    """The family's model folder, its image handling as the recipe builds it (`Run.chat_tokenizer`), the
    model as the recipe loads it with LoRA, and the three rows encoded."""
    folder = tmp_path_factory.mktemp(request.param)
    expected = EXPECTED[request.param]
    path = str(expected["build"](folder / "model"))
    square_image(folder / "red.png", "red")
    square_image(folder / "blue.png", "blue")
    (folder / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    cfg = ModelConfig(path=path, method="lora")
    inputs = vision.image_inputs(cfg, VisionConfig().max_pixels)
    fmt = detect_format(ROWS[0], "rows.jsonl:1")
    encoder = VisionEncoder(fmt, inputs.processor.tokenizer, 512, True, True, inputs)
    columns, counts = encoder(next(read_source(str(folder / "rows.jsonl"), "train").read(100)))
    torch.manual_seed(0)
    model = load_model(cfg, LoraConfig(), parts=VisionConfig())
    rows = [{key: values[i] for key, values in columns.items()} for i in range(len(columns["input_ids"]))]
    return SimpleNamespace(
        kind=request.param, path=path, inputs=inputs, model=model, rows=rows, counts=counts, **expected
    )


def test_recognised_and_loaded_with_lora_on_the_language_model(family):
    assert model_class(family.path) is AutoModelForImageTextToText
    processor = family.inputs.processor
    assert type(processor).__name__ == family.processor
    assert type(processor.image_processor).__name__ == family.images
    assert family.inputs.kind == family.kind
    assert family.inputs.image_id == family.model.config.image_token_id

    model = family.model
    assert type(model.base_model.model).__name__ == family.architecture
    counts = vision.trained_by_part(model)
    assert counts["tower"][0] == 0 and counts["projector"][0] == 0
    assert counts["tower"][1] > 0 and counts["projector"][1] > 0
    assert counts["language model"][0] > 0
    assert f"vision: {family.kind}; tower frozen" in vision.parts_line(model)
    adapted = {name for name, param in model.named_parameters() if param.requires_grad}
    assert adapted and all("lora_" in name for name in adapted)
    assert {vision.part_of(name) for name in adapted} == {"language model"}
    assert {name.split(".lora_")[0].rpartition(".")[2] for name in adapted} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }


def test_only_the_answers_are_labelled(family):
    assert family.counts == {"truncated": 0, "dropped": 0}
    assert len(family.rows) == 3
    tokenizer = family.inputs.processor.tokenizer
    image_id = family.inputs.image_id
    for row, answer, images in zip(family.rows, ANSWERS, (1, 2, 0)):
        ids, labels = row["input_ids"], row["labels"]
        assert len(ids) == len(labels)
        assert ids.count(image_id) == images * family.per_image
        trained = [token for token, label in zip(ids, labels) if label != IGNORE]
        assert trained == [label for label in labels if label != IGNORE]
        # Idefics3's template puts the space after "Assistant:" in the answer's turn.
        assert tokenizer.decode(trained).lstrip() == answer + family.end
        assert all(label == IGNORE for token, label in zip(ids, labels) if token == image_id)
        assert len(row["images"]) == images


def collate(family, rows):
    return VisionCollator(family.inputs.processor.tokenizer.pad_token_id, family.inputs)(rows)


def test_collator_gives_the_family_pixel_inputs(family):
    batch = collate(family, family.rows)
    image_tokens = batch["input_ids"] == family.inputs.image_id
    assert int(image_tokens.sum()) == 3 * family.per_image
    if family.kind == "gemma3":  # one 56 x 56 image after another, and 1 at every image token
        assert batch["pixel_values"].shape == (3, 3, 56, 56)
        assert torch.equal(batch["token_type_ids"], image_tokens.long())
    else:  # [rows, most crops, ...]: 5 crops per image, a row's missing crops all zero
        assert "token_type_ids" not in batch and "mm_token_type_ids" not in batch
        pixels, mask = batch["pixel_values"], batch["pixel_attention_mask"]
        assert pixels.shape == (3, 10, 3, 56, 56) and mask.shape == (3, 10, 56, 56)
        real = pixels.flatten(2).ne(0).any(-1)
        assert real.tolist() == [[True] * 5 + [False] * 5, [True] * 10, [False] * 10]
        assert torch.equal(mask.flatten(2).any(-1), real)


def test_one_step_trains_the_adapter_and_sees_the_images(family):
    model = family.model
    batch = collate(family, family.rows)
    model.train()
    model.zero_grad()
    loss = batch_loss(model, batch) / batch_targets(batch)
    assert torch.isfinite(loss)
    loss.backward()
    grads = {name: param.grad for name, param in model.named_parameters() if param.requires_grad}
    assert all(grad is not None and torch.isfinite(grad).all() for grad in grads.values())
    assert any(grad.abs().sum() > 0 for name, grad in grads.items() if "lora_B" in name)
    frozen = [name for name, param in model.named_parameters() if vision.part_of(name) != "language model"]
    assert frozen and all(model.get_parameter(name).grad is None for name in frozen)
    model.zero_grad()

    with torch.no_grad():
        dimmed = batch_loss(model, {**batch, "pixel_values": batch["pixel_values"] * 0.5})
    assert not torch.isclose(dimmed / batch_targets(batch), loss.detach()), "the images reach the loss"


def test_a_text_batch_runs_the_tower_on_a_masked_stand_in(family):
    text = family.rows[2]
    batch = collate(family, [text, text])
    width = len(text["input_ids"])
    assert "pixel_values" in batch
    assert int((batch["input_ids"][0] == family.inputs.image_id).sum()) == family.per_image
    assert batch["attention_mask"][0, width:].sum() == 0 and (batch["labels"][0, width:] == IGNORE).all()

    model = family.model
    tower = next(
        module for name, module in model.named_modules() if vision.part_of(f"{name}.weight") == "tower"
    )
    calls = []
    handle = tower.register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            model.eval()
            loss = batch_loss(model, batch)
            plain = Collator(family.inputs.processor.tokenizer.pad_token_id)([text, text])
            alone = batch_loss(model, plain)
    finally:
        handle.remove()
    assert calls, "the tower ran on the stand-in image"
    assert torch.isfinite(loss)
    assert torch.allclose(loss, alone, atol=1e-4), "the stand-in changes nothing of the text rows' loss"
