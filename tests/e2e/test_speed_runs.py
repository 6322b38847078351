"""Speed features in a real run: unavailable ones fall back with a note, compile keeps the math."""

import pytest
from helpers import run_recipe, step_losses

from toolkit.model.speed import can_compile


def test_unavailable_features_run_with_notes(tmp_path):
    result = run_recipe(
        tmp_path / "run",
        "model.attn_implementation=flash_attention_2",
        "model.liger_kernels=true",
        "train.fused_adamw=true",
        "data.packing=true",
    )
    for note in ("flash_attention_2 needs a CUDA GPU", "liger_kernels: needs a CUDA GPU", "fused_adamw"):
        assert note in result.stdout
    assert len(step_losses(tmp_path / "run")) == 4


def test_compiled_model_trains_like_eager(tmp_path):
    if not can_compile():
        pytest.skip("torch.compile cannot build kernels here (no C++ compiler, or no Triton on CUDA)")
    settings = ["data.packing=true", "train.max_steps=3", "eval.max_batches=1"]
    run_recipe(tmp_path / "eager", *settings)
    # Inductor's own kernel cache is shared with earlier runs (a cold one costs minutes on two cores); the
    # recipe's only way to run uncompiled is the fallback that prints this note.
    compiled = run_recipe(tmp_path / "compiled", *settings, "model.compile=true")
    assert "running uncompiled" not in compiled.stdout + compiled.stderr
    assert step_losses(tmp_path / "compiled") == pytest.approx(step_losses(tmp_path / "eager"), rel=1e-4)
