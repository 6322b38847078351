"""recipes/embed_llm.py end to end on the embedded model: held-out retrieval before and after, a
sentence-transformers folder that embeds as ftkit does, exact resume, a cached step (GradCache) equal to the
one-pass step, and DDP, FSDP2, ZeRO-2, ZeRO-3 and ZeRO-3 with offload on 2 gloo processes giving one
process's per-step losses (the negatives gathered from both processes); rerankers (listwise, and pointwise
under QLoRA) and a classifier, each on 2 processes as on one; `ftkit export` of each run's last checkpoint
loading as its final/ does.

Launches: started warm (tests/warm.py); one per backend, the single-process runs in-process children."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers import REPO, run_script, train_lines

from toolkit.commands import cli
from toolkit.embed.data import read_triplets
from toolkit.embed.evaluate import retrieval_set
from toolkit.embed.metrics import retrieval_metrics
from toolkit.embed.saved import load_embedder
from toolkit.train.metrics import read_metrics

RECIPE = REPO / "recipes" / "embed_llm.py"
STEPS = 3
METRICS = ("loss", "top1_accuracy", "queries_per_s", "grad_norm")
DEMO = REPO / "toolkit" / "assets" / "demo"


@pytest.fixture(scope="module")
def triplet_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("triplets")
    for name, rows in (("train", 48), ("eval", 12)):
        lines = (DEMO / f"embed_{name}.jsonl").read_text().splitlines(True)[:rows]
        (root / f"{name}.jsonl").write_text("".join(lines))
    return root


def run_embed(out: Path, files: Path, *overrides: str, processes: int = 0, config: str = ""):
    args = [
        f"output_dir={out}",
        f"data.train={files / 'train.jsonl'}",
        f"data.eval={files / 'eval.jsonl'}",
        f"train.max_steps={STEPS}",
        "train.log_every_steps=1",
        "train.warmup_steps=0",
        "train.lr_scheduler=constant",
        "train.learning_rate=2e-3",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "data.max_length=24",
        "embed.matryoshka_dims=[32]",
        *overrides,
    ]
    return run_script(RECIPE, args, out, processes, config)


@pytest.fixture(scope="module")
def single(tmp_path_factory, triplet_files):
    out = tmp_path_factory.mktemp("embed") / "run"
    return out, run_embed(out, triplet_files, "train.save_every_steps=1")


def evaluations(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "eval_recall@1" in r]


def test_run_logs_retrieval_and_exports_a_sentence_transformers_folder(single, triplet_files, capsys):
    from sentence_transformers import SentenceTransformer

    out, result = single
    lines = train_lines(out)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    assert all(key in lines[-1] for key in METRICS)
    before, after = evaluations(out)
    assert (before["step"], after["step"], after["eval_corpus"]) == (0, STEPS, 24)
    assert "result: held-out recall@1 " in result.stdout and "over 24 passages (chance 4.2%)" in result.stdout
    assert "--query 'What is 19 plus 36?' --text 'The sum of 19 and 36 is 55.'" in result.stdout
    final = out / "final"
    assert (final / "adapter" / "adapter_config.json").is_file()  # kept beside the merged model
    # The folder embeds, through sentence-transformers and through ftkit's reader, as the run measured.
    rows = read_triplets(str(triplet_files / "eval.jsonl"), "train")
    queries, corpus, relevant = retrieval_set(rows, "")
    ours = load_embedder(final)
    theirs = SentenceTransformer(str(final), device="cpu")
    by_ftkit = ours.encode(queries, query=True), ours.encode(corpus)
    by_st = (
        theirs.encode_query(queries, convert_to_tensor=True),
        theirs.encode(corpus, convert_to_tensor=True),
    )
    for a, b in zip(by_ftkit, by_st, strict=True):
        torch.testing.assert_close(a, b.float(), atol=1e-5, rtol=0)
    measured = retrieval_metrics(by_ftkit[0] @ by_ftkit[1].T, relevant, 5, prefix="eval_")
    for key, value in measured.items():
        assert value == pytest.approx(after[key], abs=1e-6), key
    # `ftkit export` of the last checkpoint writes the folder final/ is: it embeds the same.
    exported = exported_checkpoint(out, "sentence-transformers model", capsys)
    assert (exported / "adapter" / "adapter_config.json").is_file()
    again = SentenceTransformer(str(exported), device="cpu").encode_query(queries, convert_to_tensor=True)
    torch.testing.assert_close(again.float(), by_ftkit[0], atol=1e-5, rtol=0)


def exported_checkpoint(out: Path, what: str, capsys) -> Path:
    """`ftkit export` (in this process) of the run's last checkpoint to a folder beside the run."""
    step = max((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    folder = out.parent / f"export-{step.name}"
    capsys.readouterr()
    assert cli.main(["export", str(step), "--out", str(folder)]) == 0
    assert capsys.readouterr().out.startswith(f"exported {what} ("), what
    return folder


def test_ftkit_embed_prints_vectors_and_similarities(single, capsys):
    out, _ = single
    final = str(out / "final")
    texts = ["The sum of 19 and 36 is 55.", "Adding 5 and 57 gives 62."]
    assert cli.main(["embed", "--model", final, "--text", texts[0]]) == 0
    vector = json.loads(capsys.readouterr().out.strip())
    expected = load_embedder(final).encode(texts[:1])[0]
    assert len(vector) == 160 and vector == pytest.approx(expected.tolist(), abs=1e-6)
    assert (
        cli.main(
            [
                "embed",
                "--model",
                final,
                "--query",
                "What is 19 plus 36?",
                *sum([["--text", t] for t in texts], []),
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("\t")[1] for line in lines] == texts
    assert all(-1 <= float(line.split("\t")[0]) <= 1 for line in lines)


def test_resume_continues_exactly(single, triplet_files, tmp_path):
    out, _ = single
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    for later in (copy / "checkpoints").glob("step-*"):
        if int(later.name[5:]) > 1:
            shutil.rmtree(later)
    shutil.rmtree(copy / "final")
    run_embed(copy, triplet_files, "train.save_every_steps=1")
    expected, resumed = train_lines(out), train_lines(copy)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for a, b in zip(expected[1:], resumed[1:], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)


def test_a_cached_step_gives_the_one_pass_loss(single, triplet_files, tmp_path):
    """Two micro-batches a step: embedded without gradients, the loss over both, then each re-run with its
    gradient (GradCache): the same per-step losses as one pass over the whole batch."""
    out, _ = single
    run = tmp_path / "run"
    run_embed(run, triplet_files, "train.micro_batch_size=4")
    for a, b in zip(train_lines(out), train_lines(run), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("config", "micro"), [("ddp", 4), ("fsdp", 2), ("zero2", 4), ("zero3", 4), ("zero3_offload", 4)]
)
def test_backend_gives_one_process_loss(config, micro, single, triplet_files, tmp_path):
    """Each process embeds half the batch; its queries meet the other's passages through the gathered
    vectors (FSDP2 in two cached micro-batches a process)."""
    out, _ = single
    run = tmp_path / "run"
    run_embed(run, triplet_files, f"train.micro_batch_size={micro}", processes=2, config=config)
    expected, got = train_lines(out), train_lines(run)
    assert len(got) == STEPS
    for a, b in zip(expected, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5), config
    for a, b in zip(evaluations(out), evaluations(run), strict=True):
        assert b["eval_ndcg@10"] == pytest.approx(a["eval_ndcg@10"], abs=1e-5), config


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, triplet_files):
    out = tmp_path_factory.mktemp("rerank") / "run"
    return out, run_embed(out, triplet_files, "embed.task=reranker", "data.max_length=40")


def test_a_listwise_reranker_exports_a_cross_encoder_scoring_as_ftkit(reranker, triplet_files, capsys):
    from sentence_transformers import CrossEncoder

    from toolkit.embed.metrics import rank_metrics, relevant_ranks
    from toolkit.embed.rerank import from_triplet
    from toolkit.embed.saved import load_reranker

    out, result = reranker
    assert [r["step"] for r in train_lines(out)] == list(range(1, STEPS + 1))
    before, after = [r for r in read_metrics(out / "metrics.jsonl") if "eval_ndcg@10" in r]
    assert (
        "result: held-out reranking NDCG@10 " in result.stdout
        and "12 candidate lists (2 candidates each)" in result.stdout
    )
    final = out / "final"
    ours, theirs = load_reranker(final), CrossEncoder(str(final), device="cpu")
    ranks = []
    for candidates in map(from_triplet, read_triplets(str(triplet_files / "eval.jsonl"), "train")):
        scores = ours.score(candidates.query, candidates.passages)
        pairs = [[candidates.query, p] for p in candidates.passages]
        by_st = torch.as_tensor(theirs.predict(pairs, activation_fn=torch.nn.Identity()))
        torch.testing.assert_close(scores, by_st.float(), atol=1e-5, rtol=0)
        ranks += relevant_ranks(scores[None], [[0]])
    for key, value in rank_metrics(ranks, 5, prefix="eval_").items():
        assert value == pytest.approx(after[key], abs=1e-6), key
    exported = CrossEncoder(str(exported_checkpoint(out, "cross-encoder", capsys)), device="cpu")
    pairs = [["What is 19 plus 36?", "The sum of 19 and 36 is 55."], ["What is 19 plus 36?", "x"]]
    torch.testing.assert_close(
        torch.as_tensor(exported.predict(pairs, activation_fn=torch.nn.Identity())),
        torch.as_tensor(theirs.predict(pairs, activation_fn=torch.nn.Identity())),
        atol=1e-5,
        rtol=0,
    )
    assert cli.main(["embed", "--model", str(final), "--query", "What is 19 plus 36?", "--text", "x"]) == 0
    assert capsys.readouterr().out.strip().endswith("\tx")


def test_a_pointwise_qlora_reranker_trains_on_scored_pairs(triplet_files, tmp_path, capsys):
    """QLoRA on the 64-wide tiny model (bitsandbytes' 4-bit layers on CPU take widths of 64s): its export
    is the dequantized base with the adapter merged, and so is `ftkit export`'s of its last checkpoint."""
    from sentence_transformers import CrossEncoder

    points = tmp_path / "points.jsonl"
    with points.open("w") as f:
        for row in read_triplets(str(triplet_files / "train.jsonl"), "train"):
            for passage, score in ((row.positive, 1.0), (row.negatives[0], 0.0)):
                f.write(json.dumps({"query": row.anchor, "passage": passage, "score": score}) + "\n")
    out = tmp_path / "run"
    run_embed(
        out,
        triplet_files,
        "embed.task=reranker",
        "embed.rerank_loss=pointwise",
        f"data.train={points}",
        "data.eval=null",
        "data.eval_fraction=0.1",
        "data.max_length=40",
        f"model.path={REPO / 'toolkit' / 'assets' / 'tiny-llama-q64'}",
        "model.method=qlora",
    )
    lines = train_lines(out)
    assert len(lines) == STEPS and all(0 < r["loss"] < 2 for r in lines)
    assert (out / "final" / "config_sentence_transformers.json").is_file()
    pairs = [["What is 19 plus 36?", "The sum of 19 and 36 is 55."], ["What is 19 plus 36?", "x"]]
    scores = [
        CrossEncoder(str(folder), device="cpu").predict(pairs, activation_fn=torch.nn.Identity())
        for folder in (out / "final", exported_checkpoint(out, "cross-encoder", capsys))
    ]
    torch.testing.assert_close(torch.as_tensor(scores[1]), torch.as_tensor(scores[0]), atol=1e-5, rtol=0)
    assert scores[0][0] != pytest.approx(scores[0][1], abs=1e-4)  # the head scores pairs apart


def test_the_embedded_encoder_is_mean_pooled_and_exports_as_it_embeds(triplet_files, tmp_path):
    """The BERT-style tiny model (scripts/build_encoder_asset.py): pooled by the mean with no pooling key
    set, fully fine-tuned, and sentence-transformers embeds with its export as ftkit does."""
    from sentence_transformers import SentenceTransformer

    out = tmp_path / "run"
    run_embed(
        out, triplet_files, f"model.path={REPO / 'toolkit' / 'assets' / 'tiny-bert'}", "model.method=full"
    )
    assert json.loads((out / "final" / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"]
    lines = train_lines(out)
    assert len(lines) == STEPS and all(math.isfinite(r["loss"]) for r in lines)
    texts = ["The sum of 19 and 36 is 55.", "Adding 5 and 57 gives 62."]
    theirs = SentenceTransformer(str(out / "final"), device="cpu").encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(load_embedder(out / "final").encode(texts), theirs.float(), atol=1e-5, rtol=0)


FORMS = {"What is": "symbol", "Compute": "compute", "Add": "add"}


@pytest.fixture(scope="module")
def labelled(tmp_path_factory, triplet_files) -> Path:
    """Intent-like labels (which form a question takes) of the triplets' queries."""
    texts = tmp_path_factory.mktemp("texts")
    for name in ("train", "eval"):
        with (texts / f"{name}.jsonl").open("w") as f:
            for row in read_triplets(str(triplet_files / f"{name}.jsonl"), "train"):
                label = next(v for k, v in FORMS.items() if row.anchor.startswith(k))
                label = "word" if label == "symbol" and "plus" in row.anchor else label
                f.write(json.dumps({"text": row.anchor, "label": label}) + "\n")
    return texts


CLASSIFIER = ["embed.task=classifier", "embed.labels=[symbol, word, compute, add]", "train.max_steps=4"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, labelled):
    out = tmp_path_factory.mktemp("classify") / "run"
    return out, run_embed(out, labelled, *CLASSIFIER)


def test_a_classifier_learns_labels_and_exports_a_sequence_classifier(classifier, capsys):
    """Accuracy and F1 per label held out, the export a sequence classifier with the labels' names, and so
    is `ftkit export`'s of its last checkpoint."""
    from transformers import AutoModelForSequenceClassification

    out, result = classifier
    before, after = [r for r in read_metrics(out / "metrics.jsonl") if "eval_accuracy" in r]
    assert {"eval_macro_f1", "eval_f1/symbol", "eval_f1/add"} <= set(after)
    assert "result: held-out accuracy " in result.stdout and "over 12 texts, macro F1" in result.stdout
    names = {0: "symbol", 1: "word", 2: "compute", 3: "add"}
    for folder in (out / "final", exported_checkpoint(out, "sequence classifier", capsys)):
        assert AutoModelForSequenceClassification.from_pretrained(folder).config.id2label == names
    assert cli.main(["embed", "--model", str(out / "final"), "--text", "Add 3 and 4."]) == 0
    label, probability, text = capsys.readouterr().out.strip().split("\t")
    assert label in FORMS.values() or label == "word"
    assert 0 < float(probability) <= 1 and text == "Add 3 and 4."


@pytest.mark.multiproc
@pytest.mark.parametrize(("task", "config"), [("reranker", "zero3"), ("classifier", "ddp")])
def test_a_head_on_two_processes_gives_one_process_loss(task, config, request, triplet_files, tmp_path):
    """Each row's loss stands alone: the processes' sums over the global batch, divided by its rows, are
    one process's step loss (the listwise reranker under ZeRO-3, the classifier under DDP)."""
    reference, _ = request.getfixturevalue(task)
    run = tmp_path / "run"
    if task == "reranker":
        overrides, files = ["embed.task=reranker", "data.max_length=40"], triplet_files
    else:
        overrides, files = CLASSIFIER, request.getfixturevalue("labelled")
    result = run_embed(run, files, *overrides, "train.micro_batch_size=4", processes=2, config=config)
    assert "| world 2 |" in result.stdout, result.stdout[-2000:]
    expected, got = train_lines(reference), train_lines(run)
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for a, b in zip(expected, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5), (task, a["step"])
        assert b["top1_accuracy"] == pytest.approx(a["top1_accuracy"], abs=1e-9), (task, a["step"])
