"""Evaluation in one process: each rank's share of the eval rows, the prompt/answer split of a row, and the
Evaluator's loss, log lines and answers on the embedded tiny model."""

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from helpers import REPO
from transformers import AutoModelForCausalLM, AutoTokenizer

from toolkit import data
from toolkit.config import EvalConfig
from toolkit.data import IGNORE, RankShard
from toolkit.train.evaluate import Evaluator
from toolkit.train.generation import chat_prompt_ids, greedy_answer, split_prompt
from toolkit.train.loss import count_targets
from toolkit.train.metrics import MetricsLog, read_metrics


def rows(count: int) -> list[dict]:
    """Row i: ids (i, 100 + i, 200 + i), trained on its last two."""
    return [{"input_ids": [i, 100 + i, 200 + i], "labels": [IGNORE, 100 + i, 200 + i]} for i in range(count)]


def trains(row: dict) -> bool:
    return any(label != IGNORE for label in row["labels"])


@pytest.mark.parametrize("size", [1, 2, 5, 7, 8])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_eval_row_is_scored_exactly_once_across_ranks(size, world):
    shards = [RankShard(rows(size), rank, world) for rank in range(world)]
    assert len({len(shard) for shard in shards}) == 1  # lockstep: as many forward passes on every rank
    scored = [shard[i] for shard in shards for i in range(len(shard))]
    assert sorted(row["input_ids"][0] for row in scored if trains(row)) == list(range(size))
    for row in scored:
        assert len(row["labels"]) == len(row["input_ids"])


def test_the_ranks_eval_loaders_count_each_target_once():
    dataset = rows(7)
    loaders = [data.eval_loader(dataset, rank, 3, batch_size=2, pad_id=0) for rank in range(3)]
    assert len({len(loader) for loader in loaders}) == 1
    seen = sum(count_targets(batch["labels"]) for loader in loaders for batch in loader)
    assert seen == 2 * len(dataset)


def test_the_first_trained_span_is_the_answer_and_what_precedes_it_the_prompt():
    first = {"input_ids": [1, 2, 5, 6, 9], "labels": [IGNORE, IGNORE, 5, 6, IGNORE]}
    assert split_prompt(first) == ([1, 2], [5, 6])
    to_the_end = {"input_ids": [1, 3, 4], "labels": [IGNORE, 3, 4]}
    assert split_prompt(to_the_end) == ([1], [3, 4])
    two_turns = {"input_ids": [0, 2, 3, 4, 5], "labels": [IGNORE, 2, IGNORE, IGNORE, 5]}
    assert split_prompt(two_turns) == ([0], [2])
    assert split_prompt({"input_ids": [1, 2], "labels": [1, 2]}) is None  # no prompt to answer
    assert split_prompt({"input_ids": [1, 2], "labels": [IGNORE, IGNORE]}) is None  # nothing to answer


@pytest.fixture(scope="module")
def one_thread():
    """A 2M-parameter model runs fastest on one thread; more only wait on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(one_thread):
    path = REPO / "toolkit" / "assets" / "tiny-llama"
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def question(tokenizer, text: str, answer: str) -> dict:
    prompt = chat_prompt_ids(tokenizer, text)
    reply = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    return {"input_ids": prompt + reply, "labels": [IGNORE] * len(prompt) + reply}


@torch.no_grad()
def token_mean_loss(model, dataset) -> tuple[float, int]:
    total, count = 0.0, 0
    for row in dataset:
        logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1]
        targets = torch.tensor(row["labels"][1:])
        total += F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum").item()
        count += int((targets != IGNORE).sum())
    return total / count, count


def test_evaluator_logs_the_token_mean_loss_and_reports_answers(tiny, tmp_path, capsys):
    model, tokenizer = tiny
    prompt = chat_prompt_ids(tokenizer, "What is 1 + 2?")
    said = greedy_answer(model, tokenizer, prompt, 1, synced=False)
    # The first reference is what the model says, the second one it cannot say in 1 token: half right.
    dataset = [
        question(tokenizer, "What is 1 + 2?", said),
        question(tokenizer, "What is 3 + 4?", "7 7 7 7 7"),
    ]
    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=True)
    loader = data.eval_loader(dataset, 0, 1, batch_size=2, pad_id=tokenizer.pad_token_id)
    cfg = EvalConfig(exact_match_samples=2, max_new_tokens=1)
    evaluator = Evaluator(Accelerator(cpu=True), model, tokenizer, loader, dataset, cfg, log)

    result = evaluator.evaluate(5)
    loss, count = token_mean_loss(model, dataset)
    assert result["eval_loss"] == pytest.approx(loss, rel=1e-5) and result["eval_tokens"] == count
    evaluator.report(9, "after")
    records = read_metrics(log.path)
    assert [r["step"] for r in records] == [5, 9]
    assert records[1]["exact_match"] == 0.5
    assert records[1]["eval_loss"] == pytest.approx(loss, rel=1e-5)
    out = capsys.readouterr().out
    assert "[after] eval_loss=" in out and "[after] sample: " in out and f"-> {said!r}" in out


def test_without_eval_rows_only_the_configured_prompt_is_answered(tiny, tmp_path, capsys):
    model, tokenizer = tiny
    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=True)
    cfg = EvalConfig(sample_prompt="What is 2 + 2?", max_new_tokens=1, exact_match_samples=5)
    evaluator = Evaluator(Accelerator(cpu=True), model, tokenizer, None, None, cfg, log)
    assert evaluator.evaluate(3) == {}
    evaluator.report(0, "before")
    assert not log.path.exists()
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("[before] sample: ") and "What is 2 + 2?" in out[0]


def test_every_run_ends_with_its_result_where_it_went_and_how_to_try_it(tmp_path):
    from toolkit.train.steps import closing_lines

    shown = {
        "before": {"eval_loss": 6.0, "exact_match": 0.33},
        "after": {"eval_loss": 0.5, "exact_match": 0.46},
    }
    lines = closing_lines(shown, tmp_path / "final", "What is 38 + 47?")
    assert lines == [
        "result: held-out exact match 33.0% -> 46.0%",
        f"saved: {(tmp_path / 'final').resolve()}",
        f"try: ftkit generate --model {tmp_path / 'final'} --prompt 'What is 38 + 47?'",
    ]
    loss_only = closing_lines({"before": {"eval_loss": 6.0}, "after": {"eval_loss": 0.25}}, tmp_path, None)
    assert loss_only[0] == "result: held-out eval loss 6 -> 0.25" and loss_only[2].endswith("--prompt ...")
    assert closing_lines({"after": {"exact_match": 0.5}}, tmp_path, None)[0].endswith("(resumed) 50.0%")
    assert closing_lines({}, tmp_path, None)[0] == "result: no held-out evaluation (data.eval)"
