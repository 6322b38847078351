"""Speed features in a real run: unavailable ones fall back with a note, compile keeps the math.

Launches: started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher): what the runs compute
and print is what is tested.
"""

import pytest
from helpers import run_recipe, step_losses

from toolkit.model.speed import can_compile

SETTINGS = ["data.packing=true", "train.max_steps=3", "eval.max_batches=1"]


@pytest.fixture(scope="module")
def fallen_back(tmp_path_factory):
    """A run asking for every speed feature this CPU lacks: each falls back to the default (the same math),
    so it is also the eager run the compiled one is compared with."""
    out = tmp_path_factory.mktemp("fallback") / "run"
    result = run_recipe(
        out,
        *SETTINGS,
        "model.attn_implementation=flash_attention_2",
        "model.liger_kernels=true",
        "train.fused_adamw=true",
    )
    return out, result


def test_unavailable_features_run_with_notes(fallen_back):
    out, result = fallen_back
    for note in ("flash_attention_2 needs a CUDA GPU", "liger_kernels: needs a CUDA GPU", "fused_adamw"):
        assert note in result.stdout
    assert len(step_losses(out)) == 3


def test_compiled_model_trains_like_eager(fallen_back, tmp_path):
    if not can_compile():
        pytest.skip("torch.compile cannot build kernels here (no C++ compiler, or no Triton on CUDA)")
    eager, _ = fallen_back
    # Inductor's own kernel cache is shared with earlier runs (a cold one costs minutes on two cores); the
    # recipe's only way to run uncompiled is the fallback that prints this note.
    compiled = run_recipe(tmp_path / "compiled", *SETTINGS, "model.compile=true")
    assert "running uncompiled" not in compiled.stdout + compiled.stderr
    assert step_losses(tmp_path / "compiled") == pytest.approx(step_losses(eager), rel=1e-4)
