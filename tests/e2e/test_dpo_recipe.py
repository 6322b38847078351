"""recipes/dpo_llm.py end to end on the embedded model: LoRA (reference = adapter off) and full fine-tune
(reference log-probs precomputed and reused on resume), exact resume, export, a start from an SFT adapter,
and every shipped accelerate config on 2 gloo processes giving one process's per-step loss.

Launches: started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher), except sp_zero3's,
which launches for real (its one real launch here).
"""

import shutil
from pathlib import Path

import pytest
import torch
from helpers import REPO, demo_pair_files, pair_run_args, run_script, train_lines
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from toolkit.checkpoint import portable
from toolkit.commands import cli
from toolkit.model.for_generation import load_for_generation
from toolkit.preference.reference import FILE as REFERENCE_FILE
from toolkit.train.metrics import read_metrics

RECIPE = REPO / "recipes" / "dpo_llm.py"
STEPS = 3
LEARNING_RATE = {"lora": "1e-3", "full": "1e-4"}
METRICS = (
    "loss",
    "rewards_chosen",
    "rewards_rejected",
    "reward_accuracy",
    "reward_margin",
    "logps_chosen",
    "logps_rejected",
    "pairs_per_s",
    "tokens_per_s",
)


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    return demo_pair_files(tmp_path_factory.mktemp("pairs"), 32, 8)


def run_dpo(out: Path, pair_files: Path, method: str, *overrides: str, processes: int = 0, config: str = ""):
    args = [
        *pair_run_args(out, pair_files, STEPS),
        f"model.method={method}",
        f"train.learning_rate={LEARNING_RATE[method]}",
        "data.max_length=64",
        # Length-grouped pair batches everywhere: each backend and resume below also covers that order.
        "data.group_by_length=true",
        "eval.exact_match_samples=0",
        # The DPO term alone (the demo adds the chosen NLL), so the checks below see its arithmetic.
        "dpo.sft_weight=0",
        *overrides,
    ]
    return run_script(RECIPE, args, out, processes, config)


def resume_from_step(out: Path, step: int) -> None:
    """Leave the run as if it had stopped right after checkpointing `step`."""
    for later in (out / "checkpoints").glob("step-*"):
        if int(later.name[5:]) > step:
            shutil.rmtree(later)
    shutil.rmtree(out / "final")


@pytest.fixture(scope="module", params=["lora", "full"])
def single(request, tmp_path_factory, pair_files):
    out = tmp_path_factory.mktemp(f"dpo-{request.param}") / "run"
    result = run_dpo(out, pair_files, request.param, "train.save_every_steps=1")
    return request.param, out, result


def test_run_logs_preference_metrics_and_exports(single):
    method, out, result = single
    lines = train_lines(out)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    assert all(key in lines[-1] for key in METRICS)
    assert lines[-1]["loss"] < lines[0]["loss"]
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval_loss" in r]
    assert evals[0]["eval_reward_margin"] == 0 and evals[-1]["eval_reward_margin"] > 0
    exported = "adapter_config.json" if method == "lora" else "model.safetensors"
    assert (out / "final" / exported).is_file()
    assert ((out / REFERENCE_FILE).is_file()) == (method == "full")
    assert "train pairs" in result.stdout and "0 truncated, 0 dropped" in result.stdout


def test_resume_continues_exactly_and_reuses_the_reference(single, pair_files, tmp_path):
    method, out, _ = single
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    resume_from_step(copy, 1)
    result = run_dpo(copy, pair_files, method, "train.save_every_steps=1")
    expected, resumed = train_lines(out), train_lines(copy)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for a, b in zip(expected[1:], resumed[1:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    if method == "full":
        assert "reference log-probs: read from" in result.stdout


@pytest.mark.multiproc
def test_start_from_an_sft_adapter_makes_it_the_reference(single, pair_files, tmp_path):
    method, out, _ = single
    if method != "lora":
        pytest.skip("one start is enough")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(REPO / "toolkit" / "assets" / "tiny-llama")
    adapter = get_peft_model(
        base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    adapter.save_pretrained(tmp_path / "sft")
    run = tmp_path / "run"
    run_dpo(run, pair_files, "lora", f"model.adapter={tmp_path / 'sft'}", "train.max_steps=1")
    before = [r for r in read_metrics(run / "metrics.jsonl") if r["step"] == 0][0]
    plain = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] == 0][0]
    assert before["eval_reward_margin"] == 0 and before["eval_rewards_chosen"] == 0
    assert before["eval_logps_chosen"] != pytest.approx(plain["eval_logps_chosen"], rel=1e-3)
    # The exported adapter applies to the base with the SFT adapter folded in, as trained: every weight
    # that loading final/ (and a checkpoint export of it) gives equals the trained model's checkpoint.
    trained = portable.read_weights(run / "checkpoints" / "step-1")
    assert cli.main(["export", str(run / "checkpoints" / "step-1"), "--out", str(tmp_path / "exported")]) == 0
    for exported in (run / "final", tmp_path / "exported"):
        assert (exported / "start_adapter" / "adapter_config.json").is_file()
        loaded = load_for_generation(exported)[0].state_dict()
        assert set(loaded) == set(trained)
        for name, tensor in trained.items():
            torch.testing.assert_close(loaded[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    # Under ZeRO-3 the base is partitioned as it loads: the start adapter is merged into gathered weights
    # (peft's plain merge met empty partitions), and the run is the one process's.
    sharded = tmp_path / "zero3"
    run_dpo(sharded, pair_files, "lora", f"model.adapter={tmp_path / 'sft'}", "train.max_steps=1",
            processes=2, config="zero3")  # fmt: skip
    start = [r for r in read_metrics(sharded / "metrics.jsonl") if r["step"] == 0][0]
    assert start["eval_logps_chosen"] == pytest.approx(before["eval_logps_chosen"], rel=1e-5)
    assert train_lines(sharded)[0]["loss"] == pytest.approx(train_lines(run)[0]["loss"], rel=1e-3)


# LoRA where DPO's reference (the policy with its adapter off) meets another sharding; full fine-tuning
# where the policy's parameters are sharded or gathered unlike DDP. ZeRO-1 (ZeRO-2 without gradient
# partitioning) and offload are SFT's matrix's cases: DPO adds nothing there (ZeRO-3 with offload partitions
# the policy and the reference as ZeRO-3 does, full: below; it moves them and the optimizer to the CPU,
# LoRA-zero3_offload in tests/e2e/test_backends.py; the full fine-tune under it, folded, took 330 s here).
# Sequence parallelism splits both rows of each pair: LoRA under sp_zero3 (ZeRO-3, the launch of accelerate's
# guide YAML), whose reference (the adapter switched off) ftkit precomputes itself, as SP requires; full
# fine-tuning under sp_dp is tests/e2e/test_sequence_parallel.py's (a Qwen2 shape).
# DDP and ZeRO-2 under LoRA, and DDP under full fine-tuning, were folded: they keep every weight whole on
# every rank, as one process does, so the pair arithmetic they check is the one-process run's.
FULL_MATRIX = ["fsdp", "zero3"]
MATRIX = ["fsdp", "zero3", "sp_zero3"]
# A separate reference is prepared three ways: by accelerate (FSDP; DDP's case folded), as a ZeRO-0 engine
# (ZeRO-1/2) and as a ZeRO-3 engine (toolkit/preference/reference.py).
REFERENCE_MATRIX = ["fsdp", "zero2", "zero3"]


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "config", [pytest.param(c, marks=pytest.mark.real_launch) if c == "sp_zero3" else c for c in MATRIX]
)
def test_backend_gives_one_process_loss(config, single, pair_files, tmp_path):
    method, out, _ = single
    if method == "full" and config not in FULL_MATRIX:
        pytest.skip("full fine-tuning with sequence parallelism: tests/e2e/test_sequence_parallel.py (sp_dp)")
    run = tmp_path / "run"
    result = run_dpo(run, pair_files, method, processes=2, config=config)
    if config.startswith("sp"):  # the adapter-off reference, precomputed by ftkit itself under SP
        assert "dpo.precompute_reference: on (sp 2 splits each row" in result.stdout
        assert (run / REFERENCE_FILE).is_file()
    expected, got = train_lines(out), train_lines(run)
    assert len(got) == STEPS
    for a, b in zip(expected, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3), (config, method)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    """A frozen reference unlike the starting policy, so the rewards differ from zero from step 0."""
    path = tmp_path_factory.mktemp("reference") / "model"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(REPO / "toolkit" / "assets" / "tiny-llama")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn_like(param))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def separate_single(reference_dir, pair_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo-separate") / "run"
    run_dpo(out, pair_files, "full", f"dpo.reference_model={reference_dir}")
    return out


def test_separate_reference_live_equals_its_precomputed_values(
    separate_single, reference_dir, pair_files, tmp_path
):
    start = [r for r in read_metrics(separate_single / "metrics.jsonl") if r["step"] == 0][0]
    assert abs(start["eval_reward_margin"]) > 1e-4  # scored against the given model, not the start
    run = tmp_path / "run"
    run_dpo(run, pair_files, "full", f"dpo.reference_model={reference_dir}", "dpo.precompute_reference=true")
    assert (run / REFERENCE_FILE).is_file()
    for a, b in zip(train_lines(separate_single), train_lines(run), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


@pytest.mark.multiproc
@pytest.mark.parametrize("config", REFERENCE_MATRIX)
def test_separate_reference_gives_one_process_loss(
    config, separate_single, reference_dir, pair_files, tmp_path
):
    run = tmp_path / "run"
    run_dpo(run, pair_files, "full", f"dpo.reference_model={reference_dir}", processes=2, config=config)
    expected, got = train_lines(separate_single), train_lines(run)
    assert len(got) == STEPS
    for a, b in zip(expected, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3), config
        assert b["rewards_chosen"] == pytest.approx(a["rewards_chosen"], rel=1e-2, abs=1e-4), config
