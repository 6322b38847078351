"""Pipeline pieces on one process: how layers are split into stages, which models and splits are refused, the
micro-batches at one fixed shape, and the model trimmed to some stages (the whole model's names kept, and
its forward, stage after stage)."""

import copy

import pytest
import torch
from helpers import tiny_llama_config
from peft import get_peft_model
from torch import nn
from transformers import GPT2Config, LlamaForCausalLM, MistralConfig, Qwen2Config

from toolkit.config import LoraConfig
from toolkit.data.encode import IGNORE
from toolkit.model.load import peft_config
from toolkit.pipeline import batches, stages

PAD = 7


def test_equal_layers_split_evenly():
    assert stages.balanced([10] * 8, 0, 0, 2) == [4, 4]
    assert stages.balanced([10] * 8, 0, 0, 4) == [2, 2, 2, 2]
    assert stages.balanced([10] * 4, 0, 0, 4) == [1, 1, 1, 1]


def test_embeddings_and_head_shift_layers_away_from_their_stages():
    # 3 layers beside the embeddings (55) against 5 (50): 2 would leave 60 on the second stage.
    assert stages.balanced([10] * 8, 25, 0, 2) == [3, 5]
    assert stages.balanced([10] * 8, 0, 25, 2) == [5, 3]
    assert stages.balanced([10] * 8, 25, 25, 4) == [1, 3, 3, 1]


def test_balanced_is_the_best_partition_by_hand():
    """Layers of 4, 1, 1, 4, 2 parameters, 3 more on the first stage, 2 on the last, 3 stages. The largest
    stage of each split: (1,1,3) 9, (1,2,2) 8, (1,3,1) 7, (2,1,2) 8, (2,2,1) 8, (3,1,1) 9."""
    assert stages.balanced([4, 1, 1, 4, 2], 3, 2, 3) == [1, 3, 1]


def test_a_given_split_must_cover_the_stages_and_layers():
    assert stages.layers_problem([], 2, 4) is None
    assert stages.layers_problem([1, 3], 2, 4) is None
    assert stages.layers_problem([1, 2], 2, 4) == (
        "pipeline.layers [1, 2] gives 2 stages of 3 layers; the launch has 2 stages and the model 4 layers"
    )
    assert "gives 3 stages of 4 layers" in stages.layers_problem([2, 1, 1], 2, 4)


def test_models_a_pipeline_cannot_split_are_named():
    assert stages.model_problem(tiny_llama_config(), 2) is None
    assert stages.model_problem(Qwen2Config(num_hidden_layers=2), 2) is None
    assert stages.model_problem(MistralConfig(num_hidden_layers=2), 2) is None
    tied = stages.model_problem(tiny_llama_config(tie_word_embeddings=True), 2)
    assert tied.startswith("the model ties its output head to its input embeddings")
    gpt2 = stages.model_problem(GPT2Config(tie_word_embeddings=False), 2)
    assert gpt2.startswith("model type gpt2 is not split into pipeline stages")
    assert stages.model_problem(tiny_llama_config(num_hidden_layers=4), 4) is None  # one layer a stage
    few = stages.model_problem(tiny_llama_config(num_hidden_layers=3), 4)
    assert few == "the model has 3 decoder layers, fewer than 4 stages"


def plain_batch() -> dict:
    """Two right-padded rows, as toolkit.data.collate.Collator makes them."""
    ids = torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, PAD, PAD]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    labels = torch.tensor([[IGNORE, IGNORE, 13, 14, 15], [IGNORE, 22, 23, IGNORE, IGNORE]])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed_batch() -> dict:
    """One row holding two examples (3 and 2 tokens) and a padding token, as PackedCollator makes it."""
    return {
        "input_ids": torch.tensor([[31, 32, 33, 41, 42, PAD]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]]),
        "labels": torch.tensor([[IGNORE, 32, 33, IGNORE, 42, IGNORE]]),
        "token_mask": torch.tensor([[1, 1, 1, 1, 1, 0]]),
    }


def test_plain_rows_are_padded_without_labels_or_attention():
    ids, positions, mask, labels = batches.padded(plain_batch(), rows=3, width=8, pad_id=PAD)
    assert ids.shape == positions.shape == mask.shape == labels.shape == (3, 8)
    assert torch.equal(ids[:2, :5], plain_batch()["input_ids"])
    assert (ids[:, 5:] == PAD).all() and (ids[2] == PAD).all()
    assert torch.equal(labels[:2, :5], plain_batch()["labels"])
    assert (labels[:, 5:] == IGNORE).all() and (labels[2] == IGNORE).all()
    assert torch.equal(mask[:2, :5], plain_batch()["attention_mask"]) and (mask[:2, 5:] == 0).all()
    assert (mask[2] == 1).all()  # a row added to fill the micro-batch attends to itself (no empty softmax)
    assert torch.equal(positions, torch.arange(8).repeat(3, 1))


def test_packed_rows_keep_their_restarting_positions_and_attend_everywhere():
    ids, positions, mask, labels = batches.padded(packed_batch(), rows=2, width=8, pad_id=PAD)
    assert ids.shape == positions.shape == mask.shape == labels.shape == (2, 8)
    assert positions[0].tolist() == [0, 1, 2, 0, 1, 0, 0, 1]  # the padding joins no example
    assert positions[1].tolist() == list(range(8))
    assert (mask == 1).all()
    assert ids[0].tolist() == [31, 32, 33, 41, 42, PAD, PAD, PAD] and (ids[1] == PAD).all()
    assert labels[0].tolist() == [IGNORE, 32, 33, IGNORE, 42] + [IGNORE] * 3 and (labels[1] == IGNORE).all()


def test_a_micro_batch_larger_than_the_pipeline_shape_is_refused():
    with pytest.raises(ValueError, match="a micro-batch of 2 x 5 exceeds the pipeline's 1 x 8"):
        batches.padded(plain_batch(), rows=1, width=8, pad_id=PAD)
    with pytest.raises(ValueError, match="exceeds the pipeline's 2 x 4"):
        batches.padded(plain_batch(), rows=2, width=4, pad_id=PAD)


def test_stacked_micro_batches_are_padded_ones_in_order():
    one_row = {key: value[1:] for key, value in plain_batch().items()}
    parts = [plain_batch(), packed_batch(), one_row]
    columns = batches.stacked(parts, rows=2, width=8, pad_id=PAD)
    assert all(column.shape == (6, 8) for column in columns)
    for i, part in enumerate(parts):
        for column, expected in zip(columns, batches.padded(part, rows=2, width=8, pad_id=PAD)):
            assert torch.equal(column[2 * i : 2 * i + 2], expected)


def test_pipeline_width_is_the_collators_rounding():
    assert [batches.pipeline_width(n) for n in (1, 8, 60, 64, 65)] == [8, 8, 64, 64, 72]


def tiny_model(layers: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=layers)).double()


def test_trim_keeps_the_whole_models_names():
    model = tiny_model()
    whole = dict(model.named_parameters())
    assert not stages.is_part(model)
    kept = stages.trim(model, [1, 2, 1], [1])
    assert stages.is_part(model) and isinstance(model.model.layers, nn.ModuleDict)
    names = dict(model.named_parameters())
    assert {n for n in whole if n.startswith("model.layers.")} >= set(names)
    assert {n.split(".")[2] for n in names} == {"1", "2"}  # stage 1 of [1, 2, 1]: layers 1 and 2
    assert all(names[n] is whole[n] for n in names)  # the same parameters, not copies
    assert model.model.embed_tokens is None and model.model.norm is None and model.lm_head is None
    assert len(kept) == 1 and list(kept[0].decoder) == [model.model.layers["1"], model.model.layers["2"]]
    # A replicated checkpoint's optimizer state is numbered in the whole model's order.
    assert model.pipeline_whole_trained == [(n, tuple(p.shape)) for n, p in whole.items()]


def test_trim_to_interleaved_stages_keeps_the_ends_of_the_model():
    model = tiny_model()
    first = stages.trim(copy.deepcopy(model), [1, 1, 1, 1], [0, 2])
    assert [s.embed is not None for s in first] == [True, False]
    assert all(s.head is None for s in first)
    last = copy.deepcopy(model)
    stages.trim(last, [1, 1, 1, 1], [1, 3])
    assert set(last.model.layers) == {"1", "3"} and last.model.embed_tokens is None
    assert {n for n, _ in last.named_parameters() if not n.startswith("model.layers.")} == {
        "model.norm.weight",
        "lm_head.weight",
    }


def test_trim_of_a_lora_model_keeps_the_adapter_names():
    base = tiny_model()
    model = get_peft_model(base, peft_config(LoraConfig(target_modules="all-linear", dropout=0.0), base))
    whole = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not stages.is_part(model)
    stages.trim(model, [2, 2], [1])
    assert stages.is_part(model)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and trained < whole
    assert all(".model.layers.2." in n or ".model.layers.3." in n for n in trained)


def test_stages_one_after_another_compute_the_whole_models_log_probs():
    """Right padding, a packed row and a filler row through 3 stages on one process: each real position's
    next-token log-prob as the whole model gives it, each example run alone; 0 where there is no label."""
    model = tiny_model()
    whole = copy.deepcopy(model)
    pieces = stages.trim(model, [1, 2, 1], [0, 1, 2])
    outputs = []
    for micro_batch in (plain_batch(), packed_batch()):  # a schedule runs the stages a micro-batch at a time
        flow = batches.padded(micro_batch, 2, 8, PAD)
        for stage in pieces:
            flow = stage(*flow)
        outputs.append(flow)
    flow = torch.cat(outputs)
    ids, _, _, labels = batches.stacked([plain_batch(), packed_batch()], 2, 8, PAD)
    expected = torch.zeros(4, 8, dtype=torch.float64)
    examples = [(0, 0, 5), (1, 0, 3), (2, 0, 3), (2, 3, 5)]  # (row, start, stop) of each example
    with torch.no_grad():
        for row, start, stop in examples:
            logps = whole(input_ids=ids[row : row + 1, start:stop]).logits[0].float().log_softmax(-1)
            for t in range(start, stop - 1):
                if labels[row, t + 1] != IGNORE:
                    expected[row, t] = logps[t - start, labels[row, t + 1]]
    assert flow.shape == (4, 8)
    assert (expected != 0).sum() == 8
    torch.testing.assert_close(flow.double(), expected, rtol=0, atol=1e-6)
