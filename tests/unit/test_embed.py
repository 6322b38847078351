"""toolkit/embed/: the triplet layout and its one-line refusals, pooling, the contrastive loss (in-batch and
hard negatives, temperature, Matryoshka sizes, GradCache), gathered across 2 gloo processes with its
gradients, and the retrieval metrics."""

import json
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from accelerate.utils.other import get_free_port as free_port
from helpers import REPO, run_launched

from toolkit.config import ModelConfig
from toolkit.embed import config as embed_config
from toolkit.embed.data import TripletCollator, build_embed_data, groups, read_triplets, to_triplet
from toolkit.embed.loss import cached_gradients, info_nce, step_terms, surrogate
from toolkit.embed.metrics import relevant_ranks, retrieval_metrics
from toolkit.embed.pooling import model_pooling, pool, resolve_pooling
from toolkit.errors import UserError

sys.path.insert(0, str(REPO / "tests" / "scripts"))
import embed_gather  # noqa: E402


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_triplet_columns_and_their_aliases():
    row = to_triplet({"query": "q", "passage": "p", "negative_2": "n2", "negative_1": "n1"}, "f:1")
    assert (row.anchor, row.positive, row.negatives) == ("q", "p", ["n1", "n2"])
    assert to_triplet({"anchor": "q", "positive": "p", "negatives": ["a", "b"]}, "f:1").negatives == [
        "a",
        "b",
    ]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"anchor": "q", "postive": "p"}, r"data\.jsonl:2: column 'postive' is not one of"),
        ({"anchor": "q"}, r"data\.jsonl:2: no positive column"),
        ({"anchor": "q", "positive": ""}, r"data\.jsonl:2: column 'positive' must be a non-empty text"),
        ({"anchor": "q", "positive": "p", "negative": "n", "extra": 1}, r"data\.jsonl:2: column 'extra'"),
        ({"anchor": "q", "positive": "p"}, r"data\.jsonl:2: 0 negatives where the first record has 1"),
    ],
)
def test_a_wrong_record_is_one_line_naming_the_file_line_and_column(tmp_path, record, message):
    path = write_jsonl(tmp_path / "data.jsonl", [{"anchor": "a", "positive": "b", "negative": "c"}, record])
    with pytest.raises(UserError, match=message) as raised:
        read_triplets(str(path), "train")
    assert "\n" not in str(raised.value)


def test_held_out_rows_and_batches(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO / "toolkit" / "assets" / "tiny-llama")
    rows = [{"anchor": f"q{i}", "positive": f"p {i}", "negative": f"n {i} x"} for i in range(20)]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    cfg = embed_config.EmbedRecipeConfig().data
    cfg.train, cfg.eval_fraction = str(path), 0.1
    sets = build_embed_data(cfg, tokenizer, "Q: ", seed=0)
    assert (len(sets.train), len(sets.eval), sets.negatives) == (18, 2, 1)
    assert {t.anchor for t in sets.eval}.isdisjoint(tokenizer.decode(r) for r in sets.train["anchor_ids"])
    assert tokenizer.decode(sets.train[0]["anchor_ids"]).startswith("Q: q")
    batch = TripletCollator(tokenizer.pad_token_id)([sets.train[0], sets.train[1]])
    assert batch["input_ids"].shape[0] == 6  # 2 anchors, 2 positives, 2 negatives
    split = groups(torch.arange(6), 1)
    assert [split[k].tolist() for k in ("anchor", "positive", "negative")] == [[0, 1], [2, 3], [4, 5]]


def test_too_small_a_batch_for_in_batch_negatives_is_refused():
    with pytest.raises(UserError, match="train.global_batch_size: 1 leaves a query no in-batch negative"):
        embed_config.load_embed_config(None, ["train.global_batch_size=1", "train.micro_batch_size=1"])


def test_pooling_reads_the_real_tokens_on_either_side_of_the_padding():
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert pool(hidden, right, "last").tolist() == [hidden[0, 1].tolist(), hidden[1, 3].tolist()]
    assert pool(hidden, left, "last").tolist() == [hidden[0, 3].tolist(), hidden[1, 3].tolist()]
    assert pool(hidden, right, "mean")[0].tolist() == hidden[0, :2].mean(0).tolist()
    assert pool(hidden, right, "cls").tolist() == hidden[:, 0].tolist()


def test_auto_pooling_by_model_kind(tmp_path):
    assert model_pooling(ModelConfig(path=str(REPO / "toolkit" / "assets" / "tiny-llama")), "auto") == "last"
    assert resolve_pooling("auto", "somewhere", "bert") == "mean"
    assert resolve_pooling("cls", "somewhere", "llama") == "cls"
    with pytest.raises(UserError, match="cannot tell how to pool its embeddings .* set embed.pooling"):
        resolve_pooling("auto", str(tmp_path), "vit")


def reference_loss(anchors, positives, negatives, temperature):
    """InfoNCE written out: each query's positive against every positive and negative."""
    keys = F.normalize(torch.cat([positives, negatives]), dim=-1)
    total = 0.0
    for i, query in enumerate(F.normalize(anchors, dim=-1)):
        logits = keys @ query / temperature
        total += -(logits[i] - torch.logsumexp(logits, 0))
    return total


def test_info_nce_with_hard_negatives_temperature_and_matryoshka():
    torch.manual_seed(0)
    anchors, positives, negatives = (torch.randn(4, 6, dtype=torch.float64) for _ in range(3))
    terms = info_nce(anchors, positives, negatives, 0.1)
    assert terms.loss_sum.item() == pytest.approx(reference_loss(anchors, positives, negatives, 0.1).item())
    without = info_nce(anchors, positives, None, 0.1).loss_sum.item()
    assert without == pytest.approx(reference_loss(anchors, positives, negatives[:0], 0.1).item())
    nested = info_nce(anchors, positives, negatives, 0.1, [3]).loss_sum.item()
    part = reference_loss(anchors[:, :3], positives[:, :3], negatives[:, :3], 0.1).item()
    assert nested == pytest.approx((terms.loss_sum.item() + part) / 2)
    assert info_nce(positives, positives, negatives, 0.01).correct == 4


def test_cached_gradients_equal_the_one_pass_gradients():
    encoder, features = embed_gather.whole_batch()
    terms = step_terms(encoder(embed_gather.stacked(features, slice(0, 8))), 1, 0.05, [4])
    terms.loss_sum.backward()
    expected = [p.grad.clone() for p in encoder.parameters()]
    encoder.zero_grad()
    micro = [slice(0, 3), slice(3, 8)]
    with torch.no_grad():
        vectors = [encoder(embed_gather.stacked(features, rows)) for rows in micro]
    cached, grads = cached_gradients(vectors, 1, 0.05, [4])
    for rows, grad in zip(micro, grads, strict=True):
        surrogate(encoder(embed_gather.stacked(features, rows)), grad).backward()
    assert cached.loss_sum.item() == pytest.approx(terms.loss_sum.item(), rel=1e-12)
    for got, want in zip(encoder.parameters(), expected, strict=True):
        torch.testing.assert_close(got.grad, want, rtol=1e-10, atol=1e-12)


@pytest.mark.multiproc
def test_two_gloo_processes_give_the_whole_batch_loss_and_gradients(tmp_path):
    """Each process holds half the batch; its queries meet the other half's passages and negatives through
    the gathered vectors, and the gradient flows back to the process that embedded them."""
    encoder, features = embed_gather.whole_batch()
    terms = step_terms(encoder(embed_gather.stacked(features, slice(0, 8))), 1, 0.05, [4])
    terms.loss_sum.backward()
    expected = torch.cat([p.grad.flatten() for p in encoder.parameters()])
    out = tmp_path / "result.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    command += [str(free_port()), str(REPO / "tests" / "scripts" / "embed_gather.py"), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = run_launched(command, env, keep=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    for way in ("one_pass", "cached"):
        assert result[way]["loss"] == pytest.approx(terms.loss_sum.item(), rel=1e-12), way
        torch.testing.assert_close(torch.tensor(result[way]["grad"], dtype=torch.float64), expected)


def test_retrieval_metrics_by_hand():
    scores = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.3, 0.1], [0.5, 0.5, 0.0]])
    relevant = [[0], [0], [1]]
    assert relevant_ranks(scores, relevant) == [[1], [2], [2]]  # the tie counts against the relevant one
    got = retrieval_metrics(scores, relevant, 2)
    assert got["recall@1"] == pytest.approx(1 / 3)
    assert got["recall@2"] == pytest.approx(1.0)
    assert got["mrr@10"] == pytest.approx((1 + 0.5 + 0.5) / 3)
    assert got["ndcg@10"] == pytest.approx((1 + 2 / math.log2(3)) / 3)
    two = retrieval_metrics(torch.tensor([[0.9, 0.1, 0.5]]), [[0, 1]], 2)
    assert two["ndcg@10"] == pytest.approx((1 + 1 / math.log2(4)) / (1 + 1 / math.log2(3)))
    assert two["recall@2"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.global_batch_size=1", "train.micro_batch_size=1"],
            "train.global_batch_size: 1 leaves a query no in-batch negative",
        ),
        (["model.path=MODEL"], "cannot tell how to pool its embeddings"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, overrides, message):
    from helpers import load_recipe

    from toolkit.errors import run_main

    model = tmp_path / "vision-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "vit"}))
    out = tmp_path / "run"
    argv = [f"output_dir={out}", *(o.replace("MODEL", str(model)) for o in overrides)]
    assert run_main(load_recipe("embed_llm").main, argv, "embed_llm") == 2
    shown = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(shown) == 1 and message in shown[0], shown
    assert not out.exists()


def test_scored_pairs_and_their_one_line_refusals(tmp_path):
    from toolkit.embed.rerank import grouped, read_candidates

    rows = [{"query": "q", "passage": "p", "score": 1}, {"sentence1": "q", "sentence2": "n", "label": 0.0}]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    lists = grouped(read_candidates(str(path), "train", listwise=False))
    assert [(c.query, c.passages, c.scores) for c in lists] == [("q", ["p", "n"], [1.0, 0.0])]
    write_jsonl(path, [{"query": "q", "passage": "p"}])
    with pytest.raises(UserError, match=r"pairs\.jsonl:1: no score column \(score or label\)"):
        read_candidates(str(path), "train", listwise=False)
    write_jsonl(path, [{"query": "q", "passage": "p", "score": 3}])
    with pytest.raises(UserError, match=r"pairs\.jsonl:1: column 'score' must be a number from 0 to 1"):
        read_candidates(str(path), "train", listwise=False)
    write_jsonl(path, [{"anchor": "q", "positive": "p"}])
    with pytest.raises(UserError, match="listwise needs a hard negative in every row"):
        read_candidates(str(path), "train", listwise=True)


def test_rerank_losses_by_hand():
    from toolkit.embed.rerank import rerank_loss

    scores = torch.tensor([2.0, 0.5, -1.0, 1.0, 0.0, 3.0])
    targets = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    listwise = sum(-(row[0] - torch.logsumexp(row, 0)) for row in scores.view(2, 3))
    assert rerank_loss(scores, targets, listwise=True).item() == pytest.approx(listwise.item())
    pointwise = -(
        torch.log(torch.sigmoid(scores[[0, 3]])).sum()
        + torch.log(1 - torch.sigmoid(scores[[1, 2, 4, 5]])).sum()
    )
    assert rerank_loss(scores, targets, listwise=False).item() == pytest.approx(pointwise.item(), rel=1e-6)


def test_a_reranker_file_without_scores_is_one_line_exit_2_and_nothing_written(tmp_path, capsys):
    from helpers import load_recipe

    from toolkit.errors import run_main

    data = write_jsonl(tmp_path / "pairs.jsonl", [{"query": "q", "passage": "p"}])
    out = tmp_path / "run"
    argv = [f"output_dir={out}", "embed.task=reranker", "embed.rerank_loss=pointwise", f"data.train={data}"]
    assert run_main(load_recipe("embed_llm").main, argv, "embed_llm") == 2
    shown = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(shown) == 1 and "pairs.jsonl:1: no score column" in shown[0], shown
    assert not out.exists()


def test_labelled_texts_metrics_and_a_label_outside_the_set(tmp_path, capsys):
    from helpers import load_recipe

    from toolkit.embed.classify import class_metrics, read_labelled
    from toolkit.errors import run_main

    path = write_jsonl(
        tmp_path / "texts.jsonl", [{"text": "hi", "label": "greet"}, {"sentence": "x", "label": "other"}]
    )
    assert [(r.text, r.label) for r in read_labelled(str(path), "train", ["other", "greet"])] == [
        ("hi", 1),
        ("x", 0),
    ]
    got = class_metrics([0, 1, 1, 2], [0, 1, 2, 2], ["a", "b", "c"])
    assert got["accuracy"] == 0.75
    assert (got["f1/a"], got["f1/b"], got["f1/c"]) == (1.0, pytest.approx(2 / 3), pytest.approx(2 / 3))
    assert got["macro_f1"] == pytest.approx((1 + 4 / 3) / 3)
    out = tmp_path / "run"
    argv = [f"output_dir={out}", "embed.task=classifier", "embed.labels=[greet]", f"data.train={path}"]
    assert run_main(load_recipe("embed_llm").main, argv, "embed_llm") == 2
    argv[2] = "embed.labels=[greet, bye]"
    assert run_main(load_recipe("embed_llm").main, argv, "embed_llm") == 2
    shown = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert "embed.labels: a classifier needs 2 or more distinct labels" in shown[0]
    assert shown[1].endswith(
        "texts.jsonl:2: column 'label': 'other' is not one of embed.labels ['greet', 'bye']"
    )
    assert len(shown) == 2 and not out.exists()


def test_the_demo_holds_out_sums_no_training_row_states():
    import re

    def sums(name):
        rows = read_triplets(str(REPO / "toolkit" / "assets" / "demo" / f"embed_{name}.jsonl"), "train")
        return {frozenset(map(int, re.findall(r"\d+", row.anchor))) for row in rows}, rows

    (train, train_rows), (held, held_rows) = sums("train"), sums("eval")
    assert (len(train_rows), len(held_rows)) == (2000, 150)
    assert not train & held
    assert all(row.positive != row.negatives[0] for row in train_rows + held_rows)
