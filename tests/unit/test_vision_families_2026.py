"""Qwen3.5, Qwen3.5-MoE, Gemma-4 and Gemma-4's MoE in process, each a tiny random model saved with its
processor (tests/tiny_vision_families.py): recognised from the folder alone, LoRA on the language model only
(never on the tower, the projector or Gemma-4's audio tower), full fine-tuning of the language model alone,
rows in TRL's layout trained on their answers only, the collator's pixel inputs, one forward and backward
on image rows and on text rows, generation's inputs, `ftkit plan`, and the recipe's two steps on a mix of
image and text rows."""

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import square_image
from PIL import Image
from test_vision_families import ANSWERS, ROWS
from tiny_vision_families import tiny_gemma4, tiny_gemma4_moe, tiny_qwen3_5, tiny_qwen3_5_moe
from transformers import AutoModelForImageTextToText

from toolkit.config import LoraConfig, ModelConfig, VisionConfig
from toolkit.data.collate import Collator, model_inputs
from toolkit.data.encode import IGNORE
from toolkit.data.formats import detect_format
from toolkit.data.sources import read_source
from toolkit.data.vision_rows import VisionCollator, VisionEncoder
from toolkit.model import vision
from toolkit.model.load import load_model, model_class
from toolkit.train.loss import batch_loss, batch_targets

QWEN_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
DELTA_NET = {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}
MLP = {"gate_proj", "up_proj", "down_proj"}
GEMMA4_PER_LAYER = {"per_layer_input_gate", "per_layer_projection", "per_layer_model_projection"}
# What each family must show: its classes, the end of an assistant turn, how many image tokens one 56-pixel
# image becomes (Qwen3.5: 64 x 64 in 16-pixel patches merged 2 x 2; Gemma-4: 96 x 96 in 4-pixel patches
# pooled 3 x 3) and the collator's 32-pixel stand-in image (Qwen3.5: 1; Gemma-4: at its smallest budget,
# 64), the image inputs the collator gives, and the layers LoRA adapts.
GEMMA4 = dict(
    build=tiny_gemma4,
    kind="gemma4",
    architecture="Gemma4ForConditionalGeneration",
    processor="Gemma4Processor",
    images="Gemma4ImageProcessorPil",
    end="<turn|>",
    per_image=64,
    stand_in=64,
    pixel_keys={"pixel_values", "image_position_ids"},
    adapted=QWEN_ATTENTION | MLP | GEMMA4_PER_LAYER,
)
EXPECTED = {
    "qwen3_5": dict(
        build=tiny_qwen3_5,
        kind="qwen3_5",
        architecture="Qwen3_5ForConditionalGeneration",
        processor="Qwen3VLProcessor",
        images="Qwen2VLImageProcessorPil",
        end="<|im_end|>",
        per_image=4,
        stand_in=1,
        pixel_keys={"pixel_values", "image_grid_thw"},
        adapted=QWEN_ATTENTION | DELTA_NET | MLP,
    ),
    "qwen3_5_moe": dict(
        build=tiny_qwen3_5_moe,
        kind="qwen3_5_moe",
        experts="layers.0.mlp.experts",
        architecture="Qwen3_5MoeForConditionalGeneration",
        processor="Qwen3VLProcessor",
        images="Qwen2VLImageProcessorPil",
        end="<|im_end|>",
        per_image=4,
        stand_in=1,
        pixel_keys={"pixel_values", "image_grid_thw"},
        # The shared expert's layers and its gate; the routed experts' fused tensors (peft's ParamWrapper
        # on `experts`); no router (lora.router is off).
        adapted=QWEN_ATTENTION | DELTA_NET | MLP | {"shared_expert_gate", "experts"},
    ),
    "gemma4": GEMMA4,
    "gemma4_moe": dict(
        GEMMA4,
        build=tiny_gemma4_moe,
        experts="layers.0.experts",
        # Its dense MLP beside the routed experts' fused tensors; no router (`router.proj`).
        adapted=QWEN_ATTENTION | MLP | GEMMA4_PER_LAYER | {"experts"},
    ),
}


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
        name=request.param,
        folder=folder,
        path=path,
        inputs=inputs,
        model=model,
        rows=rows,
        counts=counts,
        **expected,
    )


def adapted_layers(model) -> set[str]:
    """The last name of every module carrying an adapter (peft's parameter wrapper: the module it wraps)."""
    names = {name for name, param in model.named_parameters() if param.requires_grad}
    return {name.split(".lora_")[0].replace(".base_layer", "").rpartition(".")[2] for name in names}


def test_recognised_and_loaded_with_lora_on_the_language_model_only(family):
    assert vision.is_vision(family.kind)
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
    assert adapted_layers(model) == family.adapted


def test_gemma4_audio_tower_stays_frozen_whatever_the_keys(family):
    if family.kind != "gemma4":
        assert "audio" not in vision.trained_by_part(family.model)
        return
    audio = [name for name, _ in family.model.named_parameters() if vision.part_of(name) == "audio"]
    assert any(".audio_tower." in name for name in audio) and any(".embed_audio." in name for name in audio)
    assert "audio frozen of" in vision.parts_line(family.model)
    if family.name != "gemma4":  # the keys' checks once
        return

    everything = VisionConfig(train_projector=True, train_tower=True)
    lora = load_model(ModelConfig(path=family.path), LoraConfig(), parts=everything)
    full = load_model(ModelConfig(path=family.path, method="full"), LoraConfig(), parts=everything)
    for model in (lora, full):
        trained = {part: counts[0] for part, counts in vision.trained_by_part(model).items()}
        assert trained["audio"] == 0 and trained["tower"] > 0 and trained["projector"] > 0
        assert not any("lora_" in name for name, _ in model.named_parameters() if "audio" in name)
    assert vision.tower_blocks(full) == [
        "model.vision_tower.encoder.layers.0",
        "model.vision_tower.encoder.layers.1",
    ]


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
        assert tokenizer.decode(trained) == answer + family.end
        assert all(label == IGNORE for token, label in zip(ids, labels) if token == image_id)
        assert len(row["images"]) == images


def collate(family, rows):
    return VisionCollator(family.inputs.processor.tokenizer.pad_token_id, family.inputs)(rows)


def test_collator_gives_the_family_pixel_inputs(family):
    batch = collate(family, family.rows)
    image_tokens = batch["input_ids"] == family.inputs.image_id
    assert int(image_tokens.sum()) == 3 * family.per_image
    assert family.pixel_keys <= set(batch) and "num_soft_tokens_per_image" not in batch
    assert torch.equal(batch["mm_token_type_ids"], image_tokens.long())
    if family.kind == "gemma4":  # per image: its 4-pixel patches padded to 70 x 9, padding at (-1, -1)
        assert batch["pixel_values"].shape == (3, 630, 4 * 4 * 3)
        real = (batch["image_position_ids"] != -1).all(-1).sum(-1)
        assert real.tolist() == [24 * 24] * 3
    else:  # per image: 4 x 4 patches of 16 x 16 pixels over 2 frames, one after another
        assert batch["pixel_values"].shape == (3 * 16, 3 * 2 * 16 * 16)
        assert batch["image_grid_thw"].tolist() == [[1, 4, 4]] * 3


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

    # A random model's outputs barely move its loss (near ln(vocab) whatever it sees): the logits are asked.
    with torch.no_grad():
        seen = model(**model_inputs(batch)).logits
        dimmed = model(**model_inputs({**batch, "pixel_values": batch["pixel_values"] * 0.5})).logits
    assert (seen - dimmed).abs().max() > 1e-3, "the images reach the logits"


def test_full_fine_tuning_trains_the_language_model_only(family):
    torch.manual_seed(0)
    model = load_model(ModelConfig(path=family.path, method="full"), LoraConfig(), parts=VisionConfig())
    counts = vision.trained_by_part(model)
    assert counts["language model"][0] == counts["language model"][1]
    assert all(trained == 0 for part, (trained, _) in counts.items() if part != "language model")
    model.train()
    (batch_loss(model, collate(family, family.rows)) / 10).backward()
    grads = {vision.part_of(name) for name, param in model.named_parameters() if param.grad is not None}
    assert grads == {"language model"}


def test_moe_experts_get_their_adapters_at_twice_the_rank_for_gate_and_up(family):
    if "experts" not in vars(family):
        assert not any(".experts." in name for name, _ in family.model.named_parameters())
        return
    shapes = {
        name.split(f"{family.experts}.")[1]: tuple(param.shape)
        for name, param in family.model.named_parameters()
        if f"{family.experts}." in name and "lora_A" in name
    }
    # (rank x experts, in): gate_up_proj (64 -> 2 x 32) at rank 32, down_proj (32 -> 64) at rank 16.
    assert shapes == {"base_layer.lora_A.default.weight": (32 * 4, 64), "lora_A.default.weight": (16 * 4, 32)}


def test_gemma4_stand_in_image_is_kept_at_the_smallest_budget(family):
    """At the hub's budget of 280 soft tokens Gemma-4 resizes even the blank 32-pixel stand-in up to 256
    tokens; the stand-in is processed at the smallest budget (70: 64 tokens) instead."""
    if family.kind != "gemma4":
        return
    images = family.inputs.processor.image_processor
    images.max_soft_tokens = 280
    try:
        blank = Image.new("RGB", (32, 32))
        full = family.inputs.pixels([[blank]])
        ids, pixels = family.inputs.stand_in()
    finally:
        images.max_soft_tokens = 70
    assert (full["image_position_ids"][0] != -1).all(-1).sum() == 256 * 9
    assert ids.count(family.inputs.image_id) == 64 and pixels["pixel_values"].shape == (1, 70 * 9, 48)


def test_a_text_batch_runs_the_tower_on_a_masked_stand_in(family):
    text = family.rows[2]
    batch = collate(family, [text, text])
    width = len(text["input_ids"])
    assert "pixel_values" in batch
    assert int((batch["input_ids"][0] == family.inputs.image_id).sum()) == family.stand_in
    assert batch["attention_mask"][0, width:].sum() == 0 and (batch["labels"][0, width:] == IGNORE).all()

    model = family.model
    tower = next(
        module for name, module in model.named_modules() if vision.part_of(f"{name}.weight") == "tower"
    )
    calls = []
    handle = tower.register_forward_hook(lambda *_: calls.append(1))
    model.train()
    model.zero_grad()
    try:
        loss = batch_loss(model, batch)
        loss.backward()
        with torch.no_grad():
            model.eval()
            plain = Collator(family.inputs.processor.tokenizer.pad_token_id)([text, text])
            alone = batch_loss(model, plain)
    finally:
        handle.remove()
    assert calls, "the tower ran on the stand-in image"
    assert torch.isfinite(loss)
    assert any(
        p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n
    )
    model.zero_grad()
    assert torch.allclose(loss.detach(), alone, atol=1e-4), (
        "the stand-in changes nothing of the text rows' loss"
    )


def test_generation_reads_the_prompt_as_training_does(family):
    """The eval's greedy answers and `ftkit generate` pass the token types training passes: without them
    Qwen3.5 places the image tokens as text and Gemma-4 attends within an image causally."""
    ids, inputs = family.inputs.prompt("What colour?", [str(family.folder / "red.png")], "a test")
    prompt = torch.tensor([ids])
    assert torch.equal(inputs["mm_token_type_ids"], (prompt == family.inputs.image_id).long())
    model = family.model
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=prompt, use_cache=False, **inputs).logits[0, -1]
        generated = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=1,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **inputs,
        )
    assert torch.allclose(generated.logits[0][0], trained, atol=1e-5)


def test_ftkit_plan_plans_them_with_their_images(family):
    from toolkit.plan.estimate import make_plan
    from toolkit.plan.request import PlanRequest

    plan = make_plan(PlanRequest(model=family.path, method="lora"))
    assert plan.choice is not None and plan.fits(plan.choice)
    # Gemma-4: its processor's budget of 280 soft tokens, each pooled from 3 x 3 patches; Qwen3.5: the
    # tokens vision.max_pixels makes (768 x 768 pixels in 32-pixel merged patches).
    expected = (280, 280 * 9) if family.kind == "gemma4" else (24 * 24, 4 * 24 * 24)
    assert (plan.images.tokens, plan.images.patches) == expected


@pytest.mark.usefixtures("signal_handlers_restored")
def test_the_recipe_trains_two_steps_on_image_and_text_rows(family, recipe, tmp_path, capsys):
    from toolkit.errors import run_main
    from toolkit.train.metrics import read_metrics

    out = tmp_path / "run"
    argv = [
        f"model.path={family.path}",
        f"output_dir={out}",
        f"data.train={family.folder / 'rows.jsonl'}",
        "data.eval=null",
        "data.eval_fraction=0",
        "data.packing=false",
        "data.max_length=256",
        "train.max_steps=2",
        "train.global_batch_size=2",
        "train.micro_batch_size=2",
        "train.log_every_steps=1",
        "train.learning_rate=1e-2",
        "eval.max_batches=0",
        "eval.exact_match_samples=0",
    ]
    assert run_main(recipe.main, argv, "finetune_llm") == 0, capsys.readouterr().err[-3000:]
    steps = [line for line in read_metrics(out / "metrics.jsonl") if "loss" in line and "step" in line]
    assert [line["step"] for line in steps] == [1, 2]
    assert all(torch.isfinite(torch.tensor(line["loss"])) for line in steps)
    # Qwen3.5-MoE's routers are balanced as on a text model (Gemma-4's router is not one train/router.py
    # knows yet).
    if family.name == "qwen3_5_moe":
        assert all("router_aux_loss" in line for line in steps)
    assert (out / "final" / "adapter_model.safetensors").is_file()
    assert f"vision: {family.kind}; tower frozen" in capsys.readouterr().out
