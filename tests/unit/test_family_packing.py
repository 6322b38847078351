"""Packing is exact or it is not done, for every family of tests/tiny_families.py: each packed example's
logits are its logits alone and a packed step's loss and gradients are the unpacked step's (ftkit's packer,
collator and loss), on the hybrids with their recurrent layers run per example (toolkit/model/per_example.py),
whose state is shown to leak without it; a family whose layers cannot keep examples apart (DeepSeek-V4's
compressed attention) is shown to leak and refused at launch, in one line naming the family and the layer
kind; sequence parallelism is refused on the recurrent ones. Padding, as the DPO and GRPO recipes pad (right
for training and scoring, left for sampling), stays exact on every family."""

from __future__ import annotations

import json
from itertools import pairwise

import datasets
import numpy as np
import pytest
import torch
import transformers
from helpers import REPO
from tiny_families import FAMILIES, tiny_config
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from toolkit.config import DataConfig, ModelConfig, RecipeConfig, TrainConfig
from toolkit.data.collate import Collator, PackedCollator, flash_varlen_kwargs, model_inputs
from toolkit.data.encode import IGNORE
from toolkit.data.packing import pack_dataset
from toolkit.errors import UserError
from toolkit.launch import checks
from toolkit.launch.machine import Machine
from toolkit.launch.request import Launch
from toolkit.model import families, per_example
from toolkit.model.facts import read_model_facts
from toolkit.model.families import family_of
from toolkit.train.loss import batch_loss
from toolkit.typed_yaml import Sources

CAPACITY = 40
PAD = 3
# Layer kinds a packed row of CAPACITY tokens exercises: DeepSeek-V4's tiny model compresses every 128
# tokens, so nothing is pooled in a row this short; its layer that compresses every 4 tokens is.
EXERCISED = {"deepseek_v4": dict(layer_types=["compressed_sparse_attention", "heavily_compressed_attention"])}


def tiny_model(model_type: str):
    """The family's tiny random model in float32, shaped so a packed row exercises its every layer kind."""
    config = tiny_config(model_type, **EXERCISED.get(model_type, {}))
    torch.manual_seed(0)
    return causal_lm_class(model_type)(config).float().eval()


def causal_lm_class(model_type: str):
    """Transformers' causal LM class (Mistral 4's is listed among the image-text-to-text ones)."""
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name or MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type])


def examples(count: int = 7, seed: int = 0) -> list[dict]:
    """Lengths 6 to 19, each starting with its own index (found again in a packed row); every other one
    trained after an untrained prompt."""
    gen = np.random.default_rng(seed)
    rows = []
    for i, length in enumerate(gen.integers(6, 20, count).tolist()):
        ids = [100 + i, *gen.integers(5, 2000, length - 1).tolist()]
        prompt = 0 if i % 2 else int(gen.integers(1, length - 1))
        rows.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]})
    return rows


def packed_batch(rows: list[dict]) -> dict:
    packed, _ = pack_dataset(datasets.Dataset.from_list(rows), CAPACITY, np.random.default_rng(0))
    return PackedCollator(pad_id=PAD)(list(packed))


@torch.no_grad()
def packed_gaps(model, rows: list[dict]) -> tuple[float, float, float]:
    """(largest logit gap of any packed example against it alone, the packed step's summed loss, the same
    examples' losses unpacked, one padded row each), all by ftkit's collators and loss."""
    batch = packed_batch(rows)
    logits = model(**model_inputs(batch)).logits
    gap, alone_loss = 0.0, 0.0
    for row, positions in enumerate(batch["position_ids"].tolist()):
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        for a, b in pairwise(starts):
            if not batch["token_mask"][row, a]:
                continue
            example = Collator(pad_id=PAD)([rows[int(batch["input_ids"][row, a]) - 100]])
            alone = model(**model_inputs(example)).logits[0, : b - a]
            gap = max(gap, float((logits[row, a:b] - alone).abs().max()))
            alone_loss += float(batch_loss(model, example))
    return gap, float(batch_loss(model, batch)), alone_loss


def launch_check(tmp_path, model_type: str, launch: Launch | None = None, config=None, **data) -> None:
    """ftkit's launch checks on a recipe that trains the family's tiny model (its config.json is enough;
    `config`: keys of it changed)."""
    tiny_config(model_type, **(config or {})).save_pretrained(tmp_path)
    cfg = RecipeConfig(
        model=ModelConfig(path=str(tmp_path)),
        data=DataConfig(**data),
        train=TrainConfig(global_batch_size=16, micro_batch_size=2),
    )
    launch = launch or Launch("single", 1, 1, on_cpu=True)
    checks.check_launch(launch, cfg, read_model_facts(cfg.model), "recipe.yaml", Machine(), {})


@pytest.mark.parametrize("model_type", FAMILIES)
def test_packing_is_exact_or_refused(model_type, tmp_path):
    model = tiny_model(model_type)
    family = family_of(model.config)
    gap, packed, unpacked = packed_gaps(model, examples())
    if not family.keeps_examples_apart:
        assert gap > 1e-5, f"{model_type}: packing is refused, yet its packed logits match ({gap:.2e})"
        for key in ("packing", "streaming"):
            with pytest.raises(UserError) as refused:
                launch_check(tmp_path, model_type, **{key: True})
            message = str(refused.value)
            assert "\n" not in message and f"data.{key}" in message
            assert model_type in message and family.leaks.name in message and f"data.{key}: false" in message
        launch_check(tmp_path, model_type, group_by_length=True)
        return
    lines = per_example.install(model, family, on_gpu=False)
    assert lines == [
        f"packing: {model_type}'s {k.name} layers run each example on its own" for k in family.recurrent
    ]
    if family.recurrent:
        assert gap > 1e-4, (
            f"{model_type}: its recurrent layers leak nothing across packed examples ({gap:.2e})"
        )
        gap, packed, unpacked = packed_gaps(model, examples())
    assert gap < 1e-5, f"{model_type}: a packed example's logits differ from its own by {gap:.2e}"
    assert packed == pytest.approx(unpacked, rel=3e-7)
    launch_check(tmp_path, model_type, packing=True)
    launch_check(tmp_path, model_type, streaming=True)


@pytest.mark.parametrize(
    "model_type", [t for t in FAMILIES if family_of(tiny_config(t)).keeps_examples_apart]
)
def test_a_packed_step_has_the_unpacked_gradients(model_type):
    """One packed micro-batch's gradients are the sum of its examples' gradients alone, as close as float32
    sums in another order get (attention-only families: 1.7e-7 to 1.1e-6)."""
    model = tiny_model(model_type)
    per_example.install(model, family_of(model.config), on_gpu=False)
    rows = examples()
    batch_loss(model, packed_batch(rows)).backward()
    packed = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    for row in rows:
        batch_loss(model, Collator(pad_id=PAD)([{**row, "labels": [IGNORE, *row["labels"][1:]]}])).backward()
    alone = [p.grad for p in model.parameters() if p.grad is not None]
    gap = float(torch.cat([(a - b).flatten() for a, b in zip(packed, alone, strict=True)]).norm())
    gap /= float(torch.cat([b.flatten() for b in alone]).norm())
    assert gap < 3e-6, f"{model_type}: packed gradients differ from the unpacked ones by {gap:.2e} (relative)"


def test_sequence_parallelism_is_refused_where_a_layer_carries_state(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    sp = checks.launch_from_yaml(REPO / "accelerate_configs" / "sp.yaml", 0)
    with pytest.raises(UserError, match=r"parallelism_config_sp_size 2 .*lfm2.*short convolution"):
        launch_check(tmp_path, "lfm2", sp)
    launch_check(tmp_path / "smollm3", "smollm3", sp)


# DeepSeek-V4's compressed attention pools left padding into the first real tokens' compressed keys.
LEFT_PADDING_LEAKS = pytest.mark.xfail(strict=True, reason="compressed attention pools the left padding")


@pytest.mark.parametrize(
    "model_type", [pytest.param(t, marks=LEFT_PADDING_LEAKS) if t == "deepseek_v4" else t for t in FAMILIES]
)
@torch.no_grad()
def test_padding_keeps_every_row_exact(model_type):
    """Right padding (ftkit's Collator: SFT unpacked, DPO, GRPO's scoring) and left padding with an
    attention mask (GRPO's sampling) give each row its logits alone: transformers zeroes the padding
    before a convolution or recurrence reads it."""
    model = tiny_model(model_type)
    rows = examples(count=3)
    right = Collator(pad_id=PAD)(rows)
    logits = model(**model_inputs(right)).logits
    width = right["input_ids"].shape[1]
    left = {key: value.clone() for key, value in right.items()}
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        alone = model(torch.tensor([row["input_ids"]]), use_cache=False).logits[0]
        assert float((logits[i, :n] - alone).abs().max()) < 1e-5
        for key in ("input_ids", "attention_mask"):
            left[key][i] = right[key][i].roll(width - n)
    positions = (left["attention_mask"].cumsum(1) - 1).clamp(min=0)
    mask = left["attention_mask"]
    logits = model(left["input_ids"], attention_mask=mask, position_ids=positions, use_cache=False).logits
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        alone = model(torch.tensor([row["input_ids"]]), use_cache=False).logits[0]
        assert float((logits[i, width - n :] - alone).abs().max()) < 1e-5


def test_a_remote_code_model_is_read_by_its_model_type(tmp_path):
    """With model.trust_remote_code only config.json is read; transformers' own config class of its
    model_type still says what its layers are (Nemotron-H's legacy hybrid_override_pattern included), so
    packing passes the checks on a Mamba-2 family."""
    raw = {**tiny_config("nemotron_h").to_dict(), "hybrid_override_pattern": "M-*E"}
    del raw["layers_block_type"]
    (tmp_path / "config.json").write_text(json.dumps(raw, default=str))
    cfg = RecipeConfig(
        model=ModelConfig(path=str(tmp_path), trust_remote_code=True), data=DataConfig(packing=True)
    )
    facts = read_model_facts(cfg.model)
    assert (
        facts.config is None
        and facts.family.describe() == "1 Mamba-2 + 1 attention + 2 feed-forward-only layers"
    )
    checks.check_launch(Launch("single", 1, 1, on_cpu=True), cfg, facts, "recipe.yaml", Machine(), {})


def test_a_refusal_names_where_the_refused_value_was_set(tmp_path):
    """data.packing typed on the command line is refused as set there, not in the recipe's file."""
    tiny_config("deepseek_v4").save_pretrained(tmp_path)
    cfg = RecipeConfig(model=ModelConfig(path=str(tmp_path)), data=DataConfig(packing=True))
    facts, single = read_model_facts(cfg.model), Launch("single", 1, 1, on_cpu=True)
    for sources, said in [
        (
            Sources.given("recipes/configs/demo.yaml", ["data.packing=true"]),
            "data.packing on the command line: ",
        ),
        (
            Sources.given("recipes/configs/demo.yaml", ["train.max_steps=5"]),
            "data.packing in recipes/configs/demo",
        ),
        ("recipe.yaml", "data.packing in recipe.yaml: "),
    ]:
        with pytest.raises(UserError, match=said):
            checks.check_launch(single, cfg, facts, sources, Machine(), {})


def test_a_gpu_run_names_the_kernel_packages_it_lacks(monkeypatch):
    family = family_of(tiny_config("qwen3_next"))
    monkeypatch.setattr(families.importlib.util, "find_spec", lambda name: None)
    (note,) = families.kernel_notes(family, on_gpu=True)
    assert "qwen3_next's gated DeltaNet layers run without flash-linear-attention and causal-conv1d" in note
    assert note.endswith(
        "pip install flash-linear-attention; make install-gpu-kernels (builds causal-conv1d)"
    )
    assert families.kernel_notes(family, on_gpu=False) == []
    assert families.kernel_notes(family_of(tiny_config("smollm3")), on_gpu=True) == []
    monkeypatch.setattr(families.importlib.util, "find_spec", lambda name: object())
    assert families.kernel_notes(family, on_gpu=True) == []


def test_gpu_kernels_get_the_packed_boundaries(monkeypatch):
    """Where a kind's kernels are installed on a GPU, its layers get the batch as one row with every
    example's boundaries (cu_seq_lens_q, seq_idx) instead of running per example; Kimi delta attention,
    whose kernel transformers never hands them, still runs per example."""
    monkeypatch.setattr(per_example, "has_kernels", lambda kind: True)
    model, seen = tiny_model("qwen3_5_text"), []
    layer = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    layer.forward = lambda hidden_states, **kw: (
        seen.append((hidden_states, kw)) or torch.zeros_like(hidden_states)
    )
    (line,) = per_example.install(model, family_of(model.config), on_gpu=True)
    assert (
        line
        == "packing: qwen3_5_text's gated DeltaNet layers get the boundaries ("
        + ", ".join((families.FLA, families.CAUSAL_CONV))
        + ")"
    )
    batch = packed_batch(examples())
    model(**model_inputs(batch))
    ((hidden, kw),) = seen
    rows, width = batch["input_ids"].shape
    assert hidden.shape[:2] == (1, rows * width) and kw["attention_mask"] is None
    assert (
        kw["cu_seq_lens_q"].tolist() == flash_varlen_kwargs(batch["position_ids"])["cu_seq_lens_q"].tolist()
    )
    starts = (batch["position_ids"].reshape(1, -1) == 0).cumsum(1) - 1
    assert torch.equal(kw["seq_idx"], starts.to(torch.int32))
    kimi = tiny_model("kimi_linear")
    assert per_example.install(kimi, family_of(kimi.config), on_gpu=True) == [
        "packing: kimi_linear's Kimi delta attention layers run each example on its own"
    ]


@pytest.mark.parametrize("model_type", ["deepseek_v3", "mistral4", "kimi_linear"])
def test_latent_attention_with_fewer_key_value_heads_is_one_line(model_type, tmp_path):
    """Transformers accepts the config and fails on the first forward pass, packed or padded."""
    config = tiny_config(model_type, num_key_value_heads=2)
    with pytest.raises(RuntimeError, match="must match the size"):
        causal_lm_class(model_type)(config)(**model_inputs(Collator(pad_id=PAD)(examples(count=2))))
    with pytest.raises(
        UserError, match=r"config.json: num_key_value_heads 2 with num_attention_heads 4, .*: 4$"
    ):
        launch_check(tmp_path, model_type, config={"num_key_value_heads": 2})


def test_qwen3_5_as_its_checkpoints_are_packs_text_rows_exactly(tmp_path):
    """Qwen3.5's checkpoints are vision-language models (their text model inside, its position ids one of
    several rotary streams): packed text rows are exact there too."""
    from tiny_vision_families import tiny_qwen3_5

    model = transformers.AutoModelForImageTextToText.from_pretrained(tiny_qwen3_5(tmp_path)).float().eval()
    assert per_example.install(model, family_of(model.config), on_gpu=False)
    gap, packed, unpacked = packed_gaps(model, examples())
    assert gap < 1e-5 and packed == pytest.approx(unpacked, rel=3e-7)
