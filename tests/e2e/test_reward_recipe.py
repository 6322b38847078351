"""recipes/reward_llm.py end to end on the embedded model: a scalar head trained beside LoRA, its held-out
pairwise accuracy before and after, exact resume, the adapter and the merged sequence-classification
export scoring alike through `ftkit score`, a full fine-tune's export, and DDP, FSDP2 and ZeRO-3 on 2 gloo
processes giving one process's per-step losses.

Launches: started warm (tests/warm.py); one per backend, the single-process runs in-process children."""

import shutil
from pathlib import Path

import pytest
import torch
from helpers import REPO, demo_pair_files, pair_run_args, run_script, train_lines
from transformers import AutoModelForSequenceClassification

from toolkit.commands import cli
from toolkit.commands.score import score_cli
from toolkit.train.metrics import read_metrics

RECIPE = REPO / "recipes" / "reward_llm.py"
STEPS = 3
METRICS = ("loss", "reward_accuracy", "reward_margin", "rewards_chosen", "rewards_rejected", "pairs_per_s")


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    return demo_pair_files(tmp_path_factory.mktemp("pairs"), 32, 8)


def run_rm(out: Path, pair_files: Path, *overrides: str, processes: int = 0, config: str = ""):
    args = [
        *pair_run_args(out, pair_files, STEPS),
        "train.learning_rate=1e-3",
        "data.group_by_length=true",
        "reward.center_coefficient=0.01",
        *overrides,
    ]
    return run_script(RECIPE, args, out, processes, config)


@pytest.fixture(scope="module")
def single(tmp_path_factory, pair_files):
    out = tmp_path_factory.mktemp("rm") / "run"
    result = run_rm(out, pair_files, "train.save_every_steps=1", "export.merge=true")
    return out, result


def test_run_logs_reward_metrics_and_exports_a_scorer(single, tmp_path):
    out, result = single
    lines = train_lines(out)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    assert all(key in lines[-1] for key in METRICS)
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval_reward_accuracy" in r]
    assert [r["step"] for r in evals] == [0, STEPS]
    assert "result: held-out pairwise accuracy" in result.stdout
    assert "try: ftkit score --model" in result.stdout
    # The adapter carries the head; the merged folder is a plain sequence classifier any tool loads.
    merged = out / "final" / "merged"
    model = AutoModelForSequenceClassification.from_pretrained(merged)
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None
    answers = ["85", "58"]
    by_adapter = score_cli(str(out / "final"), "What is 38 + 47?", answers)
    by_merged = score_cli(str(merged), "What is 38 + 47?", answers)
    for a, b in zip(by_adapter, by_merged, strict=True):
        assert float(a.split("\t")[0]) == pytest.approx(float(b.split("\t")[0]), abs=1e-4)
    assert by_adapter[0].endswith("\t85")
    # A checkpoint exported on one CPU, merged, scores as the run's own export.
    exported = tmp_path / "exported"
    checkpoint = out / "checkpoints" / f"step-{STEPS}"
    assert cli.main(["export", str(checkpoint), "--out", str(exported), "--merge-lora"]) == 0
    by_checkpoint = score_cli(str(exported), "What is 38 + 47?", answers)
    for a, b in zip(by_adapter, by_checkpoint, strict=True):
        assert float(a.split("\t")[0]) == pytest.approx(float(b.split("\t")[0]), abs=1e-4)


def test_resume_continues_exactly(single, pair_files, tmp_path):
    out, _ = single
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    for later in (copy / "checkpoints").glob("step-*"):
        if int(later.name[5:]) > 1:
            shutil.rmtree(later)
    shutil.rmtree(copy / "final")
    run_rm(copy, pair_files, "train.save_every_steps=1", "export.merge=true")
    expected, resumed = train_lines(out), train_lines(copy)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for a, b in zip(expected[1:], resumed[1:], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)


def test_full_fine_tune_exports_a_sequence_classifier(pair_files, tmp_path):
    out = tmp_path / "run"
    run_rm(out, pair_files, "model.method=full", "train.max_steps=1", "train.learning_rate=1e-4")
    model = AutoModelForSequenceClassification.from_pretrained(out / "final")
    assert model.score.weight.shape == (1, model.config.hidden_size)
    assert torch.isfinite(model.score.weight).all()


@pytest.mark.multiproc
@pytest.mark.parametrize("config", ["ddp", "fsdp", "zero3"])
def test_backend_gives_one_process_loss(config, single, pair_files, tmp_path):
    out, _ = single
    run = tmp_path / "run"
    run_rm(run, pair_files, processes=2, config=config)
    expected, got = train_lines(out), train_lines(run)
    assert len(got) == STEPS
    for a, b in zip(expected, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3), config
    start = [r for r in read_metrics(run / "metrics.jsonl") if r["step"] == 0][0]
    first = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] == 0][0]
    assert start["eval_loss"] == pytest.approx(first["eval_loss"], rel=1e-5), config


def test_start_from_an_sft_adapter(pair_files, tmp_path):
    """The SFT adapter (trained on the causal LM) folds into the base under the scalar head, and the
    exported adapter, which carries it, scores as the trained model did."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(REPO / "toolkit" / "assets" / "tiny-llama")
    sft = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    sft.save_pretrained(tmp_path / "sft")
    out = tmp_path / "run"
    run_rm(out, pair_files, f"model.adapter={tmp_path / 'sft'}", "train.max_steps=1", "export.merge=true")
    assert (out / "final" / "start_adapter" / "adapter_config.json").is_file()
    answers = ["85", "58"]
    by_adapter = score_cli(str(out / "final"), "What is 38 + 47?", answers)
    by_merged = score_cli(str(out / "final" / "merged"), "What is 38 + 47?", answers)
    for a, b in zip(by_adapter, by_merged, strict=True):
        assert float(a.split("\t")[0]) == pytest.approx(float(b.split("\t")[0]), abs=1e-4)
