"""recipes/dpo_llm.py with dpo.loss kto end to end on the embedded model: the demo's pairs split into
desirable and undesirable rows, LoRA against the adapter-off reference live or precomputed (the same
losses), exact resume, and DDP, FSDP2 and ZeRO-3 on 2 gloo processes giving one process's per-step losses
(the KL estimate is the step's, whatever the split into processes).

Launches: started warm (tests/warm.py); one per backend."""

import shutil
from pathlib import Path

import pytest
from helpers import REPO, demo_pair_files, pair_run_args, run_script, train_lines

from toolkit.train.metrics import read_metrics

RECIPE = REPO / "recipes" / "dpo_llm.py"
STEPS = 3
METRICS = ("loss", "kl", "rewards_chosen", "rewards_rejected", "reward_margin", "rows_per_s")


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    return demo_pair_files(tmp_path_factory.mktemp("pairs"), 16, 4)


def run_kto(out: Path, pair_files: Path, *overrides: str, processes: int = 0, config: str = ""):
    args = [
        *pair_run_args(out, pair_files, STEPS),
        "dpo.loss=kto",
        "dpo.sft_weight=null",
        "dpo.beta=0.5",
        "kto.desirable_weight=1.2",
        "train.learning_rate=2e-3",
        "data.max_length=64",
        "eval.exact_match_samples=0",
        *overrides,
    ]
    return run_script(RECIPE, args, out, processes, config)


@pytest.fixture(scope="module")
def single(tmp_path_factory, pair_files):
    out = tmp_path_factory.mktemp("kto") / "run"
    result = run_kto(out, pair_files, "train.save_every_steps=1")
    return out, result


def test_rows_train_and_export(single):
    out, result = single
    assert "data: 32 train rows" in result.stdout
    lines = train_lines(out)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    assert all(key in lines[-1] for key in METRICS)
    assert lines[-1]["kl"] >= 0
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval_loss" in r]
    assert evals[0]["eval_reward_margin"] == 0 and evals[-1]["eval_reward_margin"] != 0
    assert (out / "final" / "adapter_config.json").is_file()


def test_precomputed_reference_gives_the_live_losses(single, pair_files, tmp_path):
    out, _ = single
    run = tmp_path / "run"
    run_kto(run, pair_files, "dpo.precompute_reference=true")
    for a, b in zip(train_lines(out), train_lines(run), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-4, abs=1e-6)


def test_resume_continues_exactly(single, pair_files, tmp_path):
    out, _ = single
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    for later in (copy / "checkpoints").glob("step-*"):
        if int(later.name[5:]) > 1:
            shutil.rmtree(later)
    shutil.rmtree(copy / "final")
    run_kto(copy, pair_files, "train.save_every_steps=1")
    for a, b in zip(train_lines(out)[1:], train_lines(copy)[1:], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)


@pytest.mark.multiproc
@pytest.mark.parametrize("config", ["ddp", "fsdp", "zero3"])
def test_backend_gives_one_process_loss(config, single, pair_files, tmp_path):
    out, _ = single
    run = tmp_path / "run"
    run_kto(run, pair_files, processes=2, config=config)
    expected, got = train_lines(out), train_lines(run)
    assert len(got) == STEPS
    for a, b in zip(expected, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3), config
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-2, abs=1e-5), config
