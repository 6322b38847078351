"""Ulysses sequence parallelism on gloo CPU processes trains like one process: SFT under the shipped sp.yaml
(ZeRO-2, through `ftkit train`), DPO with full fine-tuning under sp_dp.yaml (ZeRO-3, sp 2 x dp 2, 4
processes) on a Qwen2-shaped model
(tests/e2e/test_dpo_recipe.py has LoRA under sp_zero3 on the Llama); checkpoints resume exactly and the
export is plain HF files.

Launches: started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher; sp's through `ftkit
train`'s command line, started warm too), except sp_dp's DPO run, which launches for real (and sp_zero3's in
tests/e2e/test_dpo_recipe.py).
"""

import shutil
from pathlib import Path

import pytest
import torch
from helpers import (
    REPO,
    assert_same_weights,
    final_weights,
    launch,
    logged,
    run_ftkit_train,
    run_recipe,
    step_losses,
)
from transformers import AutoConfig, AutoModelForCausalLM

from toolkit.checkpoint.export import verify_export

pytestmark = pytest.mark.multiproc

# micro 2: global batch 8 = 2 x 4 processes under sp_dp.yaml; the one-process runs use the same settings.
SETTINGS = ["train.max_steps=6", "train.save_every_steps=3", "train.micro_batch_size=2"]
DPO = REPO / "recipes" / "dpo_llm.py"


def tiny_qwen2(path: Path) -> Path:
    """A random Qwen2 (biased q/k/v projections) with 4 heads sharing 2 key/value heads, the embedded
    tokenizer beside it."""
    shape = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    shape.update(num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=2, pad_token_id=3)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **shape)).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "toolkit" / "assets" / "tiny-llama" / name, path / name)
    return path


def preference_settings(root: Path) -> list[str]:
    """DPO from the model itself on 32 of the demo's pairs, full fine-tuning: the reference log-probs are
    computed once before training, as sequence parallelism requires."""
    demo = REPO / "toolkit" / "assets" / "demo"
    for name, rows in (("pairs_train", 32), ("pairs_eval", 8)):
        lines = (demo / f"{name}.jsonl").read_text().splitlines(True)[:rows]
        (root / f"{name}.jsonl").write_text("".join(lines))
    return [
        f"data.train={root / 'pairs_train.jsonl'}",
        f"data.eval={root / 'pairs_eval.jsonl'}",
        "model.adapter=null",
        "train.learning_rate=1e-4",
        "train.max_steps=3",
        "train.micro_batch_size=2",
        "dpo.sft_weight=0",
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (output_dir, result), each launched once for the module when first asked for."""
    done = {}
    qwen2 = [f"model.path={tiny_qwen2(tmp_path_factory.mktemp('qwen2') / 'model')}", "model.method=full"]
    dpo = [*qwen2, *preference_settings(tmp_path_factory.mktemp("pairs"))]
    cases = {
        "single": lambda out: run_recipe(out, *SETTINGS, launch=launch("single", 1)),
        "sp": lambda out: run_ftkit_train(out, "sp", *SETTINGS),
        "qwen2-dpo-single": lambda out: run_recipe(out, *dpo, launch=launch("single", 1), recipe=DPO),
        "qwen2-dpo-sp_dp": lambda out: run_recipe(out, *dpo, launch=launch("sp_dp", 4), recipe=DPO),
    }

    def get(name: str):
        if name not in done:
            out = tmp_path_factory.mktemp(name) / "run"
            done[name] = out, cases[name](out)
        return done[name]

    return get


def assert_like_one_process(out: Path, reference: Path) -> None:
    assert len(step_losses(out)) == 6
    assert step_losses(out) == pytest.approx(step_losses(reference), rel=1e-3)
    # ZeRO-3's reduce-scatter averages over every process, ZeRO-2 over the data-parallel ones: the norm says
    # the loss scale followed each (Adam alone would hide a gradient off by a constant factor).
    assert logged(out, "grad_norm") == pytest.approx(logged(reference, "grad_norm"), rel=1e-3)
    assert (out / "checkpoints" / "step-3").is_dir() and verify_export(out / "final") > 0
    got, expected = final_weights(out), final_weights(reference)
    if "lm_head.weight" in expected:  # full fine-tuning
        assert_same_weights(got, expected)
    else:
        # LoRA's B matrices start at zero: Adam turns the slices' different summation order (losses agree to
        # 1e-6) into a few percent on single near-zero elements of them; the losses above carry the math.
        assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in expected.items()}


# accelerate's guide YAML launches exactly as sp_zero3.yaml does (tests/unit/test_sequence_parallel.py), which
# trains in DPO's matrix; full fine-tuning of the Qwen2 shape under ZeRO-3 and SP is the sp_dp case below.
@pytest.mark.parametrize("name, reference, line", [("sp", "single", "backend sp 2 (gloo) | world 2 |")])
def test_sequence_parallel_trains_saves_exports_like_one_process(name, reference, line, runs):
    out, result = runs(name)
    assert line in result.stdout and "(world" in result.stdout and "/ sp 2)" in result.stdout
    assert_like_one_process(out, runs(reference)[0])


def test_sequence_parallel_resumes_exactly(runs, tmp_path):
    source, _ = runs("sp")
    out = tmp_path / "run"
    shutil.copytree(source, out)
    shutil.rmtree(out / "checkpoints" / "step-6")
    shutil.rmtree(out / "final")
    result = run_ftkit_train(out, "sp", *SETTINGS, "train.resume=auto")
    assert "resumed from" in result.stdout and "step-3 at step 3" in result.stdout
    assert step_losses(out) == pytest.approx(step_losses(source), rel=1e-6)
    assert logged(out, "grad_norm") == pytest.approx(logged(source, "grad_norm"), rel=1e-6)
    assert_same_weights(final_weights(out), final_weights(source))


@pytest.mark.real_launch
def test_preference_tuning_under_sp_x_dp_splits_both_rows_of_each_pair_like_one_process(runs):
    """DPO on a Qwen2 shape, 4 processes: 2 groups of 2, each pair's chosen and rejected rows split in two."""
    out, result = runs("qwen2-dpo-sp_dp")
    reference, _ = runs("qwen2-dpo-single")
    assert "backend sp 2 x dp 2 (gloo)" in result.stdout
    assert len(step_losses(out)) == 3
    assert step_losses(out) == pytest.approx(step_losses(reference), rel=1e-3)
    assert logged(out, "grad_norm") == pytest.approx(logged(reference, "grad_norm"), rel=1e-3)
    assert logged(out, "reward_margin") == pytest.approx(
        logged(reference, "reward_margin"), rel=1e-3, abs=1e-6
    )
    # sp_dp.yaml's end-to-end case (SFT's code path is the same; SFT runs under sp and the guide's YAML).
    assert (out / "checkpoints" / "step-3").is_dir() and verify_export(out / "final") > 0
    assert_same_weights(final_weights(out), final_weights(reference))
