"""`ftkit eval` through lm-evaluation-harness on the tiny model: the local generation task answers as the
recipe's own greedy answers do, the multiple-choice task picks what a hand computation of the choices'
log-probabilities picks, an adapter scores as its merged model, and the before/after table with its
files; bad input is one line each."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import REPO
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from toolkit.checkpoint import rundir
from toolkit.commands.cli import main as cli
from toolkit.commands.eval import eval_cli
from toolkit.errors import UserError
from toolkit.evaluation import compare, harness, tasks
from toolkit.evaluation.harness import Score
from toolkit.model.for_generation import load_for_generation
from toolkit.train.generation import chat_prompt_ids, greedy_answer

TINY = REPO / "toolkit" / "assets" / "tiny-llama"
LIMIT = 12


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory) -> Path:
    """A run folder as ftkit leaves it: config.yaml and final/ with a LoRA adapter (random, non-zero B, so
    it changes the answers) over the tiny model; final/merged/ holds the adapter folded in."""
    run = tmp_path_factory.mktemp("run")
    (run / "config.yaml").write_text(f"model:\n  path: {TINY}\n")
    (run / rundir.MARKER).write_text('{"tracker_dirs": []}\n')
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(TINY)
    adapted = get_peft_model(base, LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))
    adapted.save_pretrained(run / "final")
    AutoTokenizer.from_pretrained(TINY).save_pretrained(run / "final")
    adapted.merge_and_unload().save_pretrained(run / "final" / "merged")
    AutoTokenizer.from_pretrained(TINY).save_pretrained(run / "final" / "merged")
    return run


def scored(path: Path, names: list[str]) -> dict:
    manager, specs = tasks.resolve(names, None)
    model, tokenizer = load_for_generation(path)
    return harness.evaluate(model, tokenizer, specs, manager, LIMIT, 4, samples=True), model, tokenizer


def test_the_generation_task_answers_as_the_recipes_greedy_answers(adapter_run):
    results, model, tokenizer = scored(adapter_run / "final", ["ftkit_sums"])
    rows = results["samples"]["ftkit_sums"]
    assert len(rows) == LIMIT
    hits = 0
    for row in rows:
        ours = greedy_answer(model, tokenizer, chat_prompt_ids(tokenizer, row["doc"]["question"]), 8, False)
        assert row["filtered_resps"][0].strip() == ours, row["doc"]
        hits += ours == row["doc"]["answer"]
    (score,) = harness.scores(results)
    assert (score.task, score.metric, score.samples) == ("ftkit_sums", "exact_match", LIMIT)
    assert score.value == hits / LIMIT


@torch.no_grad()
def test_the_choice_task_picks_what_the_choices_log_probabilities_pick(adapter_run):
    results, model, tokenizer = scored(adapter_run / "final", ["ftkit_sums_choice"])
    rows = results["samples"]["ftkit_sums_choice"]
    right = 0
    for row in rows:
        # lm-eval moves the context's trailing whitespace (the chat template's newline) into each choice,
        # so a choice's log-probability includes that newline's: the same for every choice.
        context = chat_prompt_ids(tokenizer, row["doc"]["question"])
        newline = context.pop()
        assert tokenizer.decode([newline]) == "\n"
        logps = []
        for choice in (row["doc"]["right"], row["doc"]["wrong"]):
            ids = context + [newline] + tokenizer(choice, add_special_tokens=False)["input_ids"]
            logits = model(input_ids=torch.tensor([ids])).logits[0, len(context) - 1 : -1].float()
            taken = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[len(context) :])[:, None])
            logps.append(float(taken.sum()))
        theirs = [float(resp[0][0]) for resp in row["resps"]]
        assert theirs == pytest.approx(logps, abs=1e-4)
        right += logps[0] > logps[1]
    (score,) = harness.scores(results)
    assert 0 < right < LIMIT and score.value == right / LIMIT
    assert score.stderr == pytest.approx(math.sqrt(score.value * (1 - score.value) / (LIMIT - 1)))


def test_an_adapter_scores_as_its_merged_model_and_the_table_is_written(adapter_run, capsys):
    names = "ftkit_sums,ftkit_sums_choice"
    adapter = json.loads(eval_cli(str(adapter_run / "final"), names, limit=LIMIT, as_json=True))
    merged = json.loads(
        eval_cli(str(adapter_run / "final" / "merged"), names, base="none", limit=LIMIT, as_json=True)
    )
    assert adapter["base"] == str(TINY)  # the adapter's own base
    assert [(r["task"], r["metric"]) for r in adapter["rows"]] == [
        ("ftkit_sums", "exact_match"),
        ("ftkit_sums_choice", "acc"),
    ]
    for ours, theirs in zip(adapter["rows"], merged["rows"], strict=True):
        assert ours["tuned"] == pytest.approx(theirs["tuned"], abs=1e-9)
        assert theirs["base"] is None and ours["base"] is not None
    written = Path(adapter["written"])
    assert written.parent == adapter_run / "eval" and written.read_text().startswith("fine-tuned: ")
    saved = json.loads(written.with_suffix(".json").read_text())
    assert set(saved["lm_eval"]) == {"fine-tuned", "base"} and saved["rows"] == adapter["rows"]
    assert cli(["eval", "--model", str(adapter_run / "final"), "--tasks", "ftkit_sums", "--limit", "2"]) == 0
    assert "| ftkit_sums | exact_match |" in capsys.readouterr().out
    assert len(list((adapter_run / "eval").iterdir())) >= 2  # a table and its JSON at least
    assert (
        rundir.foreign_entries(adapter_run) == []
    )  # the run's marker records them: an overwrite clears them


def test_a_drop_beyond_two_standard_errors_is_forgetting():
    base = [Score("t", "acc", 0.60, 0.02, True, 500), Score("u", "loss", 1.0, 0.1, False, 500)]
    tuned = [Score("t", "acc", 0.50, 0.02, True, 500), Score("u", "loss", 1.2, 0.1, False, 500)]
    table = compare.rows(tuned, base)
    assert [row.forgetting for row in table] == [True, False]  # 0.10 > 2 x 0.028; 0.2 < 2 x 0.14
    assert table[0].diff == pytest.approx(-0.10) and table[0].diff_stderr == pytest.approx(
        math.hypot(0.02, 0.02)
    )
    assert "| t | acc | 0.5000 | 0.6000 | -0.1000 ± 0.0283 | forgetting |" in compare.markdown(
        table, "x", "y"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", "ftkit_sum"], "--tasks: no task 'ftkit_sum' (closest: ftkit_sums"),
        (
            ["--tasks", "ftkit_sums", "--include", "/nonexistent"],
            "--include: /nonexistent is not a directory",
        ),
        (["--tasks", " , "], "--tasks: name at least one task"),
        (["--tasks", "ftkit_sums", "--batch-size", "0"], "--batch-size: 0 is not a positive number"),
        (["--tasks", "ftkit_sums", "--gpus", "0"], "--gpus: 0 is not a number of processes"),
        # checked before launching: no process starts
        (["--tasks", "ftkit_sum", "--gpus", "2"], "--tasks: no task 'ftkit_sum' (closest: ftkit_sums"),
    ],
)
def test_bad_input_is_one_line(argv, message, capsys):
    assert cli(["eval", "--model", str(TINY), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ftkit eval: error: ") and message in err[0], err


@pytest.mark.parametrize("gpus", ["1", "2"])
def test_a_folder_without_a_model_is_one_line(tmp_path, capsys, gpus):
    assert cli(["eval", "--model", str(tmp_path), "--tasks", "ftkit_sums", "--gpus", gpus]) == 2
    assert f"--model: {tmp_path} holds no model" in capsys.readouterr().err


def test_a_call_of_only_ftkits_tasks_reads_no_index_of_lm_evals():
    """lm-eval's index of its thousands of task YAMLs takes 20 s and more here: ftkit's own tasks are whole
    configs and need none of it (a name outside them is checked against the whole index, as above)."""
    manager, specs = tasks.resolve(["ftkit_sums", "ftkit_sums_choice"], None)
    assert [spec["task"] for spec in specs] == ["ftkit_sums", "ftkit_sums_choice"]
    assert "hellaswag" not in manager.all_tasks and len(manager.all_tasks) < 100


def test_a_task_whose_data_is_on_the_hub_is_named(monkeypatch):
    manager, specs = tasks.resolve(["ftkit_sums"], None)
    hub_only = dict(specs[0], dataset_path="openai/gsm8k", dataset_kwargs={})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # The libraries read those at import, so the hub is asked anyway and found unreachable: the same failure,
    # without waiting out huggingface_hub's five retries (23 s of backoff).
    monkeypatch.setattr("huggingface_hub.utils._http.time.sleep", lambda seconds: None)
    with pytest.raises(UserError, match="--tasks: ftkit_sums needs data this machine does not have"):
        harness.check_data([hub_only], manager)


@pytest.mark.usefixtures("signal_handlers_restored")
def test_benchmarks_are_scored_before_during_and_after_training_and_plotted(recipe, tmp_path):
    from toolkit.commands.plot import panels_for, read_run
    from toolkit.errors import run_main

    run = tmp_path / "run"
    argv = [
        f"output_dir={run}",
        "train.max_steps=2",
        "train.eval_every_steps=1",
        "eval.exact_match_samples=0",
    ]
    argv += ["eval.max_batches=1", "eval.benchmarks=[ftkit_sums_choice]", "eval.benchmark_limit=6"]
    assert run_main(recipe.main, argv, "finetune_llm") == 0
    key = "bench/ftkit_sums_choice/acc"
    scored = [record for record in read_run(run) if key in record]
    assert [record["step"] for record in scored] == [0, 1, 2, 2]  # before, each evaluation, after
    assert all(record[key] * 6 == round(record[key] * 6) for record in scored)  # a share of 6 examples
    assert panels_for([("run", read_run(run))])[-1] == (key, "ftkit_sums_choice/acc")


def test_an_unknown_benchmark_is_one_line_before_training(tmp_path, capsys):
    from helpers import load_recipe

    from toolkit.errors import run_main

    argv = [f"output_dir={tmp_path / 'run'}", "eval.benchmarks=[ftkit_sumz]"]
    assert run_main(load_recipe().main, argv, "finetune_llm") == 2
    assert "eval.benchmarks: no task 'ftkit_sumz' (closest: ftkit_sums" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("config", "allowed"), [("ddp", True), ("zero3", False), ("fsdp", False)])
def test_benchmarks_during_training_are_refused_where_the_model_is_split(monkeypatch, config, allowed):
    from toolkit.config import EvalConfig, RecipeConfig, TrainConfig
    from toolkit.launch import checks
    from toolkit.launch.machine import Machine
    from toolkit.model.facts import read_model_facts

    monkeypatch.chdir(REPO)
    cfg = RecipeConfig(
        train=TrainConfig(global_batch_size=16, micro_batch_size=2),
        eval=EvalConfig(benchmarks=["ftkit_sums"]),
    )
    launch = checks.launch_from_yaml(Path("accelerate_configs") / f"{config}.yaml", 0)
    call = lambda: checks.check_launch(launch, cfg, read_model_facts(cfg.model), "r.yaml", Machine(), {})  # noqa: E731
    if allowed:
        call()
        return
    with pytest.raises(UserError, match="eval.benchmarks scores the whole model on the main process"):
        call()
