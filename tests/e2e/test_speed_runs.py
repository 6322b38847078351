"""Speed features in a real run: unavailable ones fall back with a note, compile keeps the math, compiles
each graph once with the evaluation before training, and a second start loads the compiled code it kept.

Launches: started warm (tests/warm.py; `FTKIT_TEST_LAUNCH=real` for the real launcher): what the runs compute
and print is what is tested.
"""

import json
import re
from collections import Counter

import pytest
from helpers import run_recipe, step_losses

from toolkit.model.speed import can_compile
from toolkit.train.metrics import read_metrics

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


@pytest.fixture(scope="module")
def compiled_starts(fallen_back, tmp_path_factory):
    """A compiled run with the evaluation before training (held-out loss and exact-match generation), under
    dynamo's own logs; then a relaunch into the same folder whose inductor cache is empty, as on a new
    machine: it has only the compile cache the run kept. Both with a signing key of their own."""
    if not can_compile():
        pytest.skip("torch.compile cannot build kernels here (no C++ compiler, or no Triton on CUDA)")
    root = tmp_path_factory.mktemp("compiled")
    out, keys = root / "run", [*SETTINGS, "model.compile=true", "eval.exact_match_samples=2"]
    logs = {"TORCH_LOGS": "recompiles,graph_breaks,dynamo", "XDG_CACHE_HOME": str(root / "home")}
    # The first start shares inductor's kernel cache with earlier runs (a cold one costs minutes on two
    # cores); the recipe's only way to run uncompiled is the fallback that prints this note.
    first = run_recipe(out, *keys, env=logs)
    assert "running uncompiled" not in first.stdout + first.stderr
    first_losses = step_losses(out)
    fresh = {"TORCHINDUCTOR_CACHE_DIR": str(root / "empty-inductor-cache")}
    second = run_recipe(out, *keys, "train.overwrite=true", env={**logs, **fresh})
    return fallen_back[0], first, first_losses, out, second


def test_compiled_model_trains_like_eager(compiled_starts):
    eager, _, losses, _, _ = compiled_starts
    assert losses == pytest.approx(step_losses(eager), rel=1e-4)


def test_a_compiled_run_compiles_each_graph_once_with_eval_and_generation_before_training(compiled_starts):
    _, first, _, _, _ = compiled_starts
    log = first.stderr
    assert "Recompiling function" not in log and "Graph break" not in log
    traced = Counter(re.findall(r"torchdynamo start tracing (\w+)", log))
    # The decoder blocks' graph and the head's fused math, each compiled once: the evaluation, the
    # exact-match generation and the head's probe before step 1 ran eagerly and compiled nothing.
    # (transformers' decoder layers enter through `forward_with_checkpointing`, with or without it.)
    assert traced == {"forward_with_checkpointing": 1, "logps_and_grad": 1}, traced
    assert "[before] eval_loss=" in first.stdout and "exact_match=" in first.stdout


def test_a_second_start_loads_the_compiled_code_the_run_kept(compiled_starts):
    _, first, losses, out, second = compiled_starts
    assert "compile cache: none yet for this machine" in first.stdout
    manifest = json.loads(next((out / "compile-cache").glob("*.json")).read_text())
    assert manifest["written_by"] == "ftkit" and len(manifest["signature"]) == 64
    assert f"compile cache: {manifest['graphs']} compiled artifacts loaded from" in second.stdout
    counts = next(r for r in read_metrics(out / "metrics.jsonl") if "compile_cache_hits" in r)
    # Its inductor cache was empty: every compiled graph came from the run's own cache.
    assert counts["compile_cache_hits"] > 0 and counts["compile_cache_misses"] == 0, counts
    assert step_losses(out) == pytest.approx(losses, rel=1e-6)
