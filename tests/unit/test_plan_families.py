"""`ftkit plan` reads every family of tests/tiny_families.py, and what it counts for generation (the attention
layers' cache per token, a sliding window's tokens, multi-head latent attention's compressed cache, the
recurrent layers' state per sequence) is what transformers' own cache holds after a forward pass."""

from __future__ import annotations

import json

import pytest
import torch
from test_family_packing import causal_lm_class
from tiny_families import FAMILIES, tiny_config

from toolkit.commands.cli import main as cli
from toolkit.model.families import cache_elements
from toolkit.plan.counts import count_parameters, load_model_config

# State transformers keeps that the plan leaves out: DeepSeek-V4's compressed-attention layers buffer the
# tokens of a compression block not yet full (a few hundred elements a layer, never a whole sequence).
UNCOUNTED_STATE = {"deepseek_v4"}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_plan_reads_every_family(model_type, tmp_path, capsys):
    tiny_config(model_type).save_pretrained(tmp_path)
    assert cli(["plan", "--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f": {model_type}, " in out and "per GPU (GiB)" in out
    counts = count_parameters(load_model_config(str(tmp_path))[0], "lora", 8)
    if counts.state_per_sequence:
        assert f"layers   {counts.layer_kinds}" in out


def test_nemotron_h_config_with_infinity_is_read(tmp_path):
    """transformers writes Nemotron-H's time_step_limit (0, inf) as {"__float__": "Infinity"}; the plan reads
    it back as the float."""
    tiny_config("nemotron_h").save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["time_step_limit"][1] == {
        "__float__": "Infinity"
    }
    config, _ = load_model_config(str(tmp_path))
    assert list(config.time_step_limit) == [0.0, float("inf")]


def cache_numel(obj, depth: int = 0) -> int:
    """Elements of every tensor a transformers cache holds (scalars, its bookkeeping, left out)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() if obj.dim() else 0
    if isinstance(obj, (list, tuple)):
        return sum(cache_numel(x, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return sum(cache_numel(x, depth + 1) for x in obj.values())
    if hasattr(obj, "__dict__") and depth < 3:
        return sum(cache_numel(x, depth + 1) for x in vars(obj).values())
    return 0


@pytest.mark.parametrize("model_type", FAMILIES)
@torch.no_grad()
def test_generation_cache_is_what_transformers_keeps(model_type):
    config = tiny_config(model_type)
    torch.manual_seed(0)
    model = causal_lm_class(model_type)(config).eval()
    counts = count_parameters(config, "full", 8)
    held = {}
    for tokens in (16, 40):
        out = model(torch.randint(5, 2000, (1, tokens)), use_cache=True)
        held[tokens] = cache_numel(out.past_key_values)
    expected = {t: cache_elements(counts.cache, t) + counts.state_per_sequence for t in held}
    if model_type in UNCOUNTED_STATE:
        assert held[40] - held[16] == expected[40] - expected[16]
    else:
        assert held == expected


def test_deepseek_v3_from_the_built_in_table_caches_its_latent():
    """Offline by hub id; the generation cache is the 512 + 64 latent of each of its 61 layers, which tensor
    parallelism does not split, not K and V of its 128 heads."""
    config, source = load_model_config("deepseek-ai/DeepSeek-V3")
    counts = count_parameters(config, "full", 8)
    assert source == "built-in table" and counts.experts == 256
    assert counts.cache == ((512 + 64, 0),) * 61 and counts.latent_cache and not counts.state_per_sequence


@pytest.mark.parametrize(
    "model_type, refused", [("qwen3_next", True), ("nemotron_h", True), ("smollm3", False)]
)
def test_the_plan_offers_no_sequence_parallel_layout_to_a_recurrent_family(
    model_type, refused, tmp_path, capsys
):
    """The launch refuses sequence parallelism where a layer carries state; the plan gives those rows no
    numbers, with the reason, instead of recommending them."""
    tiny_config(model_type).save_pretrained(tmp_path)
    assert cli(["plan", "--model", str(tmp_path), "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    line = "zero2 + sp 2, zero3 + sp 2       no numbers: its "
    assert (line in out) == refused, out[-3000:]
    assert ("layers carry a state that a slice of the sequence cannot hand on" in out) == refused
