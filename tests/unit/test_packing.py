"""Packing: in a packed row every example gets exactly the logits and loss it gets alone, and rows come out
full; length grouping keeps each epoch's examples and pads less."""

from __future__ import annotations

from itertools import pairwise

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import REPO, tiny_llama_config
from torch._inductor.kernel.flex import flex_cpu
from transformers import AutoTokenizer, LlamaForCausalLM
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

from toolkit import data
from toolkit.config import DataConfig
from toolkit.data.collate import count_tokens, model_inputs
from toolkit.data.packing import fill_rows, pack_dataset
from toolkit.train.batches import EpochSampler
from toolkit.train.loss import IGNORE, count_targets, summed_token_loss

ASSETS = REPO / "toolkit" / "assets"
pytestmark = pytest.mark.usefixtures("private_cache")
VOCAB = 97
CAPACITY = 24


def tiny_llama(attn: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = tiny_llama_config(vocab_size=VOCAB, attn_implementation=attn)
    return LlamaForCausalLM(config).float()


def make_examples(count: int = 11, seed: int = 0) -> list[dict]:
    """Lengths 1 to 19; some trained from their first token (text), others after an untrained prompt (chat).
    Each starts with its own index, so it can be found again in a packed row."""
    gen = np.random.default_rng(seed)
    examples = []
    for i, length in enumerate(gen.integers(1, 20, count).tolist()):
        ids = [i, *gen.integers(0, VOCAB, length - 1).tolist()]
        prompt = 0 if i % 3 == 0 else int(gen.integers(0, length))
        examples.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]})
    return examples


def packed_batch(examples: list[dict], capacity: int = CAPACITY, seed: int = 0, **collator) -> dict:
    packed, _ = pack_dataset(datasets.Dataset.from_list(examples), capacity, np.random.default_rng(seed))
    return data.PackedCollator(pad_id=0, **collator)(list(packed))


def segments(batch: dict) -> list[tuple[int, int, int]]:
    """(row, start, end) of each example in a packed batch: one position 0 to the next, padding left out."""
    found = []
    for row, positions in enumerate(batch["position_ids"].tolist()):
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        found += [(row, a, b) for a, b in pairwise(starts) if batch["token_mask"][row, a]]
    return found


def target_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss of predicting each token from the one before it (0 where ignored), aligned with the tokens."""
    losses = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE, reduction="none"
    )
    return F.pad(losses.view(labels.shape[0], -1), (1, 0))


@torch.no_grad()
def worst_gaps(
    model, inputs: dict, batch: dict, examples: list[dict], alone_model=None
) -> tuple[float, float, int]:
    """Largest logit and per-example loss differences, and target-count difference, between the packed
    forward `inputs` and every example run alone the unpacked way (padded, with an attention mask), by
    `alone_model` where given (the same weights)."""
    logits = model(**inputs).logits
    alone_model = alone_model or model
    losses = target_losses(logits, batch["labels"])
    logit_gap = loss_gap = count_gap = 0
    for row, start, end in segments(batch):
        example = examples[int(batch["input_ids"][row, start])]
        alone = data.Collator(pad_id=0)([example])
        alone_logits = alone_model(**model_inputs(alone)).logits[0, : end - start]
        logit_gap = max(logit_gap, float((logits[row, start:end] - alone_logits).abs().max()))
        alone_loss = summed_token_loss(alone_logits[None], alone["labels"][:, : end - start])
        loss_gap = max(loss_gap, abs(float(losses[row, start:end].sum() - alone_loss)))
        packed_targets = int((batch["labels"][row, start:end] != IGNORE).sum())
        count_gap = max(count_gap, abs(packed_targets - count_targets(alone["labels"])))
    return logit_gap, loss_gap, count_gap


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_give_every_example_its_own_logits_and_loss(attn):
    model, examples = tiny_llama(attn), make_examples()
    batch = packed_batch(examples)
    assert len(segments(batch)) == len(examples) and batch["input_ids"].shape[0] < len(examples)
    logit_gap, loss_gap, count_gap = worst_gaps(model, model_inputs(batch), batch, examples)
    assert logit_gap < 1e-5 and loss_gap < 1e-5 and count_gap == 0
    with torch.no_grad():
        total = summed_token_loss(model(**model_inputs(batch)).logits, batch["labels"])
        alone = [data.Collator(pad_id=0)([e]) for e in examples]
        expected = sum(summed_token_loss(model(**model_inputs(a)).logits, a["labels"]) for a in alone)
    # Summed in a different order in float32, so equal to rounding only: relative, not absolute.
    assert float(total) == pytest.approx(float(expected), rel=1e-6)
    assert count_targets(batch["labels"]) == sum(count_targets(a["labels"]) for a in alone)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("leak", ["no position_ids", "cache on", "attention_mask given"])
def test_the_check_catches_attention_across_examples(attn, leak):
    """Each way of calling the model that lets packed examples see each other fails the check above."""
    model, examples = tiny_llama(attn), make_examples()
    batch = packed_batch(examples)
    inputs = model_inputs(batch)
    if leak == "no position_ids":
        del inputs["position_ids"]
    elif leak == "cache on":
        inputs["use_cache"] = True
    else:
        inputs["attention_mask"] = batch["token_mask"]
    logit_gap, loss_gap, _ = worst_gaps(model, inputs, batch, examples)
    assert logit_gap > 1e-3 and loss_gap > 1e-3


@pytest.mark.skipif(
    not flex_cpu.check_cpu_supported(),
    reason="torch compiles flex_attention for a CPU with AVX2 only (not under ATEN_CPU_CAPABILITY=default, "
    "nor on ARM); the attention it checks is CUDA's",
)
def test_flex_attention_keeps_packed_examples_apart():
    """The block mask transformers builds from the packed positions for flex_attention (what auto picks
    for packed rows on CUDA) gives every example the logits it gets alone. Forward only: torch has no CPU
    backward for flex_attention; and its CPU kernel gives NaN for rows shorter than its 128-token block,
    so the rows are padded to 128 here (on CUDA any width runs)."""
    flex, examples = tiny_llama("flex_attention"), make_examples()
    batch = packed_batch(examples, multiple=128)
    logit_gap, loss_gap, count_gap = worst_gaps(
        flex, model_inputs(batch), batch, examples, tiny_llama("sdpa")
    )
    assert logit_gap < 1e-5 and loss_gap < 1e-5 and count_gap == 0
    leaked = model_inputs(batch)
    del leaked["position_ids"]
    assert worst_gaps(flex, leaked, batch, examples, tiny_llama("sdpa"))[0] > 1e-3


def test_packed_collator_pads_into_a_segment_of_its_own():
    batch = packed_batch(make_examples())
    assert set(batch) == {"input_ids", "labels", "position_ids", "token_mask"}
    assert batch["input_ids"].shape[1] % 8 == 0
    pads = batch["token_mask"] == 0
    assert pads.any() and (batch["labels"][pads] == IGNORE).all()
    for row in range(batch["input_ids"].shape[0]):
        real = int(batch["token_mask"][row].sum())
        assert batch["position_ids"][row, real:].tolist() == list(range(batch["input_ids"].shape[1] - real))
    assert count_tokens(batch) == sum(len(e["input_ids"]) for e in make_examples())
    assert "attention_mask" not in model_inputs(batch) and model_inputs(batch)["use_cache"] is False


def test_flash_varlen_boundaries_are_the_ones_transformers_derives():
    batch = packed_batch(make_examples(), flash_varlen=True)
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(batch["position_ids"])
    assert torch.equal(batch["cu_seq_lens_q"], cu_q) and torch.equal(batch["cu_seq_lens_k"], cu_k)
    assert batch["max_length_q"] == int(max_q) and batch["max_length_k"] == int(max_k)
    assert {"cu_seq_lens_q", "max_length_k"} <= set(model_inputs(batch))


def unpack(packed: datasets.Dataset) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every example in packed rows as (input_ids, labels), split where position_ids restart."""
    examples = []
    for row in packed:
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["position_ids"])]
        for a, b in pairwise(starts):
            examples.append((tuple(row["input_ids"][a:b]), tuple(row["labels"][a:b])))
    return examples


def alpaca_like(count: int, capacity: int, seed: int = 0) -> np.ndarray:
    """Token lengths shaped like instruction data: many short answers, a long tail, cut at the limit."""
    lengths = np.random.default_rng(seed).lognormal(np.log(150), 0.9, count).round()
    return np.clip(lengths, 8, capacity).astype(np.int64)


def test_every_example_lands_once_whole_and_the_packing_is_deterministic():
    gen = np.random.default_rng(1)
    examples = [
        {"input_ids": (ids := gen.integers(0, VOCAB, n).tolist()), "labels": ids}
        for n in alpaca_like(2000, 512)
    ]
    dataset = datasets.Dataset.from_list(examples)
    packed, efficiency = pack_dataset(dataset, 512, np.random.default_rng(0))
    again, _ = pack_dataset(dataset, 512, np.random.default_rng(0))
    assert packed["input_ids"] == again["input_ids"] and packed["position_ids"] == again["position_ids"]
    assert max(len(row) for row in packed["input_ids"]) <= 512
    # The first label of each example is never a target (nothing comes before it), so packing drops it.
    expected = [(tuple(e["input_ids"]), (IGNORE, *e["labels"][1:])) for e in examples]
    assert sorted(unpack(packed)) == sorted(expected)
    assert efficiency == sum(map(len, packed["input_ids"])) / (len(packed) * 512) >= 0.98


@pytest.mark.parametrize("capacity", [512, 2048, 4096])
def test_alpaca_like_lengths_pack_at_least_98_percent_full(capacity):
    lengths = alpaca_like(20000, capacity)
    rows = fill_rows(lengths, capacity, np.random.default_rng(0))
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert max(lengths[row].sum() for row in rows) <= capacity
    assert lengths.sum() / (len(rows) * capacity) >= 0.98


def test_an_example_longer_than_a_row_is_a_programming_error():
    with pytest.raises(ValueError, match="lengths must be in"):
        fill_rows(np.array([3, 30]), 24, np.random.default_rng(0))


@pytest.mark.skipif(not (ASSETS / "demo" / "train.jsonl").is_file(), reason="embedded assets not built")
@pytest.mark.parametrize("max_length", [256, 512])
def test_demo_data_packs_at_least_98_percent_full(max_length):
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")
    cfg = DataConfig(train=str(ASSETS / "demo" / "train.jsonl"), max_length=max_length, eval_fraction=0.0)
    plain, _, _ = data.build_datasets(cfg, tokenizer, 0)
    cfg.packing = True
    packed, _, stats = data.build_datasets(cfg, tokenizer, 0)
    assert stats.packed_rows == len(packed) and stats.packing_efficiency >= 0.98
    assert f"packed into {len(packed)} rows" in stats.summary()
    expected = [(tuple(row["input_ids"]), (IGNORE, *row["labels"][1:])) for row in plain]
    assert sorted(unpack(packed)) == sorted(expected)


@pytest.mark.skipif(not (ASSETS / "demo" / "train.jsonl").is_file(), reason="embedded assets not built")
def test_examples_are_truncated_by_encoding_before_they_are_packed():
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")
    cfg = DataConfig(
        train=str(ASSETS / "demo" / "train.jsonl"),
        max_length=32,
        eval_fraction=0.0,
        assistant_only_loss=False,
        packing=True,
    )
    packed, _, stats = data.build_datasets(cfg, tokenizer, 0)
    assert stats.truncated > 0
    assert max(len(ids) for ids, _ in unpack(packed)) == 32 and max(map(len, packed["input_ids"])) <= 32


def padded_tokens(order: list[int], lengths: np.ndarray, micro_batch: int) -> int:
    return sum(
        micro_batch * int(lengths[order[i : i + micro_batch]].max())
        for i in range(0, len(order), micro_batch)
    )


def test_length_grouping_keeps_each_epochs_examples_and_pads_less():
    lengths = alpaca_like(1000, 2048)
    grouped = data.LengthGroupedSampler(lengths, global_batch_size=16, seed=3)
    plain = EpochSampler(len(lengths), 16, seed=3)
    for epoch in (0, 1):
        grouped.set_epoch(epoch)
        plain.set_epoch(epoch)
        order = list(grouped)
        assert order == list(grouped) and sorted(order) == sorted(plain)
        assert lengths[order[:16]].max() == lengths[order].max()
        assert padded_tokens(order, lengths, 4) < 0.7 * padded_tokens(list(plain), lengths, 4)
