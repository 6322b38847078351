"""`ftkit plan` on vision-language models: the language model planned as a text model, the tower's and the
projector's weights added to it, and what a micro-batch's images hold (toolkit/plan/images.py)."""

import dataclasses
import json

import pytest
import torch
from helpers import REPO

from toolkit.commands import cli
from toolkit.commands.auto_backend import plan_request
from toolkit.errors import UserError
from toolkit.launch.machine import GIB
from toolkit.model import vision
from toolkit.plan import images
from toolkit.plan.counts import count_parameters, load_model_config
from toolkit.plan.estimate import make_plan
from toolkit.plan.memory import Precision, model_state_bytes
from toolkit.plan.report import render_text
from toolkit.plan.request import PlanRequest
from toolkit.recipes import load_any_recipe_config

# The launch line names recipes/configs/ files, looked up where the line is run: a checkout's root.
pytestmark = pytest.mark.usefixtures("at_the_checkout_root")

QWEN, GEMMA = "Qwen/Qwen2.5-VL-7B-Instruct", "google/gemma-3-12b-it"
CONFIGS = {QWEN: "qwen2.5-vl-7b-lora", GEMMA: "gemma-3-12b-qlora"}
TWO_4090 = dict(gpus=2, gpu_mem=24.0)
PUBLISHED = {QWEN: (631_975_680, 44_574_464), GEMMA: (416_866_032, 4_424_832)}
"""(tower, projector) parameters: the published whole minus the language model of the same shape."""


@pytest.fixture(scope="module")
def plans():
    """The four plans the shipped configs are for: each model x LoRA and QLoRA on 2 x 24 GiB."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)
        return {
            (model, method): make_plan(PlanRequest(model=model, method=method, **TWO_4090))
            for model in (QWEN, GEMMA)
            for method in ("lora", "qlora")
        }


@pytest.mark.parametrize("method", ["lora", "qlora"])
@pytest.mark.parametrize("model", [QWEN, GEMMA])
def test_both_models_get_a_layout_and_a_launch_line_from_a_vision_config(plans, model, method):
    plan = plans[model, method]
    assert plan.choice is not None and plan.fits(plan.choice) and plan.command is not None
    assert plan.command.startswith(
        f"accelerate launch --config_file accelerate_configs/{plan.choice.backend}"
    )
    # The template is one of the vision-language configs (its data holds images), whichever model it names.
    assert any(f"--config recipes/configs/{name}.yaml" in plan.command for name in CONFIGS.values())
    text = render_text(plan)
    assert f"recommended: accelerate_configs/{plan.choice.backend}.yaml" in text
    assert "parts    tower " in text and "| language model " in text
    assert "images   1 per row x " in text
    # Tensor, pipeline and sequence parallelism refuse a vision-language model, as the launch checks do.
    assert plan.layouts and all(layout.refusal and not layout.rows for layout in plan.layouts)


def test_the_answers_on_two_24_gib_gpus(plans):
    chosen = {key: (plan.choice.backend, plan.choice.checkpointing) for key, plan in plans.items()}
    assert chosen == {
        (QWEN, "lora"): ("ddp", True),
        (QWEN, "qlora"): ("ddp", True),  # without checkpointing it needs the 5% margin
        (GEMMA, "lora"): ("fsdp", True),  # 24 GB of bf16 weights: only sharded they fit
        (GEMMA, "qlora"): ("ddp", True),
    }


@pytest.mark.parametrize("model", [QWEN, GEMMA])
def test_the_language_model_is_planned_as_a_text_model_with_the_tower_and_projector_added(plans, model):
    """The language model's counts are those of the text model of its shape; the tower and projector add
    their weights, frozen in 16-bit (QLoRA quantizes the language model only)."""
    for method in ("lora", "qlora"):
        counts = plans[model, method].counts
        tower, projector = PUBLISHED[model]
        assert (counts.vision.tower, counts.vision.projector) == (tower, projector)
        assert counts.vision.tower_trainable == counts.vision.projector_trainable == 0
        assert counts.frozen - counts.quantizable - tower - projector > 0  # embeddings and norms, 16-bit
        if method == "lora":  # every frozen weight in bf16, the tower's too
            assert (
                model_state_bytes(counts, "ddp", 2, plans[model, method].precision).frozen
                == 2 * counts.frozen
            )


def test_the_vision_language_counts_equal_the_text_model_of_the_same_shape_plus_tower_and_projector(plans):
    """Qwen2.5-VL-7B's language model has Qwen2.5-7B's shape: the plans agree but for the vision parts."""
    config, _ = load_model_config("Qwen/Qwen2.5-7B-Instruct")
    text = count_parameters(config, "qlora", 16)
    vl = plans[QWEN, "qlora"].counts
    tower, projector = PUBLISHED[QWEN]
    assert vl.trainable == text.trainable
    assert vl.quantizable == text.quantizable  # the tower and projector stay in 16-bit
    assert vl.frozen == text.frozen + tower + projector
    assert (vl.layers, vl.hidden, vl.heads, vl.kv_heads, vl.vocab) == (28, 3584, 28, 4, 152064)


def _ddp(plan):
    """The plan's row of one fixed setup: ddp, gradient checkpointing on, micro-batch 1."""
    return next(row for row in plan.rows if row.backend == "ddp" and row.checkpointing)


def _plan(model: str = QWEN, **options):
    plan = make_plan(PlanRequest(model=model, **TWO_4090, **options))
    return plan, _ddp(plan)


def test_training_the_tower_or_projector_adds_its_states_and_activations(plans):
    frozen = _ddp(plans[QWEN, "lora"])
    projector_plan, projector = _plan(train_projector=True)
    last_plan, last = _plan(train_tower=True, tower_blocks=4)
    whole_plan, whole = _plan(train_tower=True)
    # peft trains a copy of the projector beside the frozen one.
    assert projector_plan.counts.vision.projector == 2 * projector_plan.counts.vision.projector_trainable
    assert (last_plan.counts.vision.kept_blocks, whole_plan.counts.vision.kept_blocks) == (4, 32)
    assert 0 < last_plan.counts.vision.tower_trainable < whole_plan.counts.vision.tower_trainable
    for trained in (projector, last, whole):
        assert trained.states.trainable > frozen.states.trainable and trained.images > frozen.images
        assert trained.per_gpu()["total"] > frozen.per_gpu()["total"]
    assert last.images < whole.images and last.per_gpu()["total"] < whole.per_gpu()["total"]
    assert "the last 4 of its 32 blocks keep activations for backward" in render_text(last_plan)


def test_full_fine_tuning_trains_the_tower_only_when_asked():
    config = load_model_config(QWEN)[0]
    frozen = count_parameters(config, "full", 16)
    tower = count_parameters(config, "full", 16, parts=PlanRequest(QWEN, train_tower=True).vision)
    tower_params, projector = PUBLISHED[QWEN]
    assert frozen.frozen == tower_params + projector and frozen.trainable == frozen.total - frozen.frozen
    assert tower.vision.tower_trainable == tower_params and tower.trainable == frozen.trainable + tower_params


def test_image_activations_grow_with_the_pixels_and_the_images_a_row_holds(plans):
    one = plans[QWEN, "lora"]
    row = _ddp(one)
    _, larger = _plan(max_pixels=2 * 589_824)
    _, two = _plan(images_per_row=2)
    _, none = _plan(images_per_row=0)
    assert one.images == images.ImageRows(images=1, tokens=752, patches=3008, max_pixels=589_824)
    # The frozen tower keeps nothing for backward: what the images add is their pixel values, fp32 14 x 14
    # patches of 3 channels in 2 frames.
    assert row.images == 3008 * 3 * 2 * 14 * 14 * 4
    assert none.images == 0 < row.images < larger.images and row.images < two.images
    assert none.per_gpu()["total"] < row.per_gpu()["total"] < larger.per_gpu()["total"]
    shown = "images   1 per row x 752 tokens (589,824 pixels each) = 752 of the 2048 tokens"
    assert shown in render_text(one)


def test_a_preference_pair_gives_its_images_to_both_rows(plans):
    _, pair = _plan(objective="dpo")
    assert pair.images == 2 * _ddp(plans[QWEN, "lora"]).images  # chosen and rejected, the same image each


def test_gemma_images_are_a_fixed_256_tokens_whatever_their_pixels(plans):
    one = plans[GEMMA, "qlora"]
    row = _ddp(one)
    _, larger = _plan(GEMMA, method="qlora", max_pixels=4 * 589_824)
    _, four = _plan(GEMMA, method="qlora", images_per_row=4)
    assert one.images == images.ImageRows(images=1, tokens=256, patches=4096, max_pixels=589_824)
    assert larger.images == row.images < four.images
    assert row.images == 896 * 896 * 3 * 4  # the pixel values of one 896 x 896 image


def test_the_tower_peak_counts_when_it_is_above_what_the_language_model_keeps():
    """Many small rows of large images: one tower block over all the patches outweighs the rest."""
    counts = count_parameters(load_model_config(GEMMA)[0], "qlora", 16)
    rows = images.image_rows(counts.vision, counts.model_type, images=8, max_pixels=None, seq_len=2048)
    held = images.micro_batch_bytes(counts.vision, rows, 1, "qlora", Precision("bfloat16", "bf16"), True)
    assert held.peak > held.kept > 0


def test_image_tokens_must_fit_the_row():
    with pytest.raises(UserError, match=r"--images-per-row 3 x 752 image tokens exceed --seq-len 2048"):
        make_plan(PlanRequest(model=QWEN, images_per_row=3, **TWO_4090))
    # None: each image as large as the row allows (what vision.max_pixels null means under the data's cap).
    plan = make_plan(PlanRequest(model=QWEN, images_per_row=2, max_pixels=None, **TWO_4090))
    assert (plan.images.tokens, plan.images.patches) == (1024, 4096)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(images_per_row=2), r"--images-per-row is for a vision-language model; .* text model \(llama\)"),
        (dict(train_tower=True), r"--train-tower \(vision\.train_tower\) is for a vision-language model"),
    ],
)
def test_the_vision_options_are_refused_for_a_text_model(options, message):
    with pytest.raises(UserError, match=message):
        make_plan(PlanRequest(model="meta-llama/Llama-3.2-1B", **options))


def test_the_vision_options_say_what_they_need():
    with pytest.raises(UserError, match="--tower-blocks chooses the blocks --train-tower trains"):
        make_plan(PlanRequest(model=QWEN, tower_blocks=2))
    with pytest.raises(UserError, match="--objective grpo: the GRPO recipe does not train a vision-language"):
        make_plan(PlanRequest(model=QWEN, objective="grpo"))
    with pytest.raises(UserError, match="--tower-blocks 40: the tower has 32 blocks"):
        make_plan(PlanRequest(model=QWEN, train_tower=True, tower_blocks=40))


@pytest.mark.filterwarnings("ignore::FutureWarning")  # raised inside peft, about transformers
def test_a_local_tiny_qwen25_vl_config_folder_is_read(tmp_path):
    """config.json with text_config and vision_config: the counts are those of the real model it builds,
    and of peft's adapters on it as the recipe places them."""
    from peft import get_peft_model
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from toolkit.config import LoraConfig, VisionConfig
    from toolkit.model.load import peft_config

    text = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        bos_token_id=1,
        eos_token_id=2,
    )
    tower = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        fullatt_block_indexes=[2],
    )
    config = Qwen2_5_VLConfig(text_config=text, vision_config=tower, bos_token_id=1, eos_token_id=2)
    config.to_json_file(tmp_path / "config.json")
    request = PlanRequest(model=str(tmp_path), train_projector=True, seq_len=1024, lora_r=4)
    plan = make_plan(request)
    counts = plan.counts
    assert counts.source == str(tmp_path / "config.json") and counts.model_type == "qwen2_5_vl"
    torch.manual_seed(0)
    real = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig.from_json_file(tmp_path / "config.json"))
    parts = vision.trained_by_part(real)
    assert (counts.vision.tower, counts.vision.blocks, counts.vision.hidden) == (parts["tower"][1], 3, 32)
    assert counts.frozen == sum(p.numel() for p in real.parameters())  # the trained projector is a copy
    adapted = get_peft_model(real, peft_config(LoraConfig(r=4), real, VisionConfig(train_projector=True)))
    assert (counts.trainable, counts.total) == adapted.get_nb_trainable_parameters()
    assert plan.images == images.ImageRows(images=1, tokens=752, patches=3008, max_pixels=589_824)
    assert plan.choice is not None and "--config recipes/configs/" in plan.command
    assert f"model.path={tmp_path}" in plan.command and "vision.train_projector=true" in plan.command


def test_the_command_line_takes_the_vision_options(capsys):
    argv = ["plan", "--model", QWEN, "--gpus", "2", "--gpu-mem", "24", "--method", "qlora"]
    assert cli.main([*argv, "--images-per-row", "2", "--max-pixels", "200704", "--train-projector"]) == 0
    out = capsys.readouterr().out
    assert "images   2 per row x 256 tokens (200,704 pixels each) = 512 of the 2048 tokens" in out
    assert "projector 89,148,928 (44,574,464 trained)" in out
    assert cli.main([*argv, "--json", "--train-tower", "--tower-blocks", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["images"] == {"images": 1, "tokens": 752, "patches": 3008, "max_pixels": 589_824}
    assert report["model"]["vision"]["kept_blocks"] == 2
    assert report["recommendation"]["image_bytes"] > 0
    assert "vision.train_tower=true vision.tower_blocks=2" in report["recommendation"]["command"]


@pytest.mark.parametrize("model", [QWEN, GEMMA])
def test_the_shipped_vision_configs_fit_as_their_headers_say(model):
    """`ftkit train --backend auto` plans a config with its vision section; the header's launch line and
    figure are the plan's."""
    path = REPO / "recipes" / "configs" / f"{CONFIGS[model]}.yaml"
    cfg = load_any_recipe_config(path)
    request = dataclasses.replace(plan_request(cfg, [], 2, 24.0), micro_batch=1, grad_ckpt="on")
    plan = make_plan(request)
    header = path.read_text().split("\noutput_dir:")[0]
    assert f"accelerate launch --config_file accelerate_configs/{plan.choice.backend}.yaml" in header
    assert f"~{plan.choice.per_gpu()['total'] / GIB:.0f} GiB per GPU at micro-batch 1" in header
    assert plan.request.max_pixels == cfg.vision.max_pixels and plan.images.images == 1


def test_the_plan_asks_only_the_local_cache_about_a_hub_model_it_does_not_know(monkeypatch):
    """A planning question never waits on the network: offline, transformers retries a hub request for
    about 25 s before it gives up. Loading the model to train it may download its config."""
    from transformers import AutoConfig

    asked = []

    def from_pretrained(path, **kwargs):
        asked.append(kwargs.get("local_files_only", False))
        raise OSError("not cached")

    monkeypatch.setattr(AutoConfig, "from_pretrained", from_pretrained)
    from toolkit.plan import launch_line

    assert launch_line._sees("someone/unknown-model") is False
    assert vision.model_type("someone/unknown-model") is None
    assert asked == [True, False]
