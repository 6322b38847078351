"""`ftkit plan` on hybrids: a recurrent layer's training activations are what its kind keeps for backward
(toolkit/model/families.py's `Kept`), not attention's, counted by hand here from the published shapes of the
built-in table's Qwen3.5-9B and Nemotron-H-8B; the short convolution's count is what its module really saves
(its kernel path and PyTorch path keep the same tensors); and `--packing` shows the packed rows' tokens per
step, refused where packing would leak, as the recipe refuses it."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_families import FAMILIES, tiny_config
from transformers import Lfm2ForCausalLM

from toolkit.commands.cli import main as cli
from toolkit.errors import UserError
from toolkit.model.families import SHORT_CONV, family_of
from toolkit.plan import memory, pipeline
from toolkit.plan.counts import count_parameters, load_model_config
from toolkit.plan.estimate import make_plan
from toolkit.plan.memory import Precision
from toolkit.plan.parallel import Mesh
from toolkit.plan.request import PlanRequest

BF16 = Precision("bfloat16", "bf16")
E = 2  # bytes of a bf16 activation


def counts_of(model: str):
    return count_parameters(load_model_config(model)[0], "lora", 16)


def norm(h: int) -> int:
    return 4 * h + 2 * E * h


def test_qwen3_5_9b_counts_each_gated_deltanet_layer_as_what_it_keeps():
    """hidden 4096, 16 heads of 256, MLP 12288; gated DeltaNet: 16 key heads and 32 value heads of 128."""
    c = counts_of("Qwen/Qwen3.5-9B")
    h, h_a, i = 4096, 16 * 256, 12288
    keys, values, heads = 16 * 128, 32 * 128, 32
    mlp = 4 * E * i
    attention = 2 * norm(h) + 5 * E * h_a + 4 * 16 + mlp
    delta_net = (
        2 * norm(h) + E * (4 * keys + 6 * values + 3 * heads) + 4 * (heads + 64 * heads + values) + mlp
    )
    assert c.mixers.count(("gated DeltaNet",)) == 24 and c.mixers.count(("attention",)) == 8
    assert memory.stack_activation_bytes(c, BF16) == 24 * delta_net + 8 * attention
    assert memory.token_activation_bytes(c, BF16)[0] == delta_net
    # Counted as attention (as before), every layer would keep 24 x 49,408 bytes a token less.
    assert delta_net - attention == 49_408


@pytest.mark.parametrize("model_type", [t for t in FAMILIES if family_of(tiny_config(t)).recurrent])
def test_every_recurrent_family_counts_its_own_kind(model_type):
    """Each hybrid of tests/tiny_families.py names its shapes its own way; every recurrent kind it has is
    counted by its own formula, none as attention."""
    config = tiny_config(model_type)
    family = family_of(config)
    c = count_parameters(config, "lora", 8)
    assert dict(c.recurrent_kept).keys() == {kind.name for kind in family.recurrent}
    assert all(compute > 0 and inner > 0 for _, (compute, _, inner) in c.recurrent_kept)
    assert sum(kind in mixers for mixers in c.mixers for kind in dict(c.recurrent_kept)) == sum(
        family.count(kind) for kind in family.recurrent
    )


def test_nemotron_h_mixer_layers_hold_no_mlp():
    """Nemotron-H-8B: 24 Mamba-2 blocks (128 heads of 64, 8 groups of state 128), 4 attention blocks (32
    heads of 128) and 24 MLP blocks (21504 wide), one norm each."""
    c = counts_of("nvidia/Nemotron-H-8B-Base-8K")
    h, inner, heads, bc = 4096, 128 * 64, 128, 2 * 8 * 128
    mamba = norm(h) + E * (6 * inner + 2 * bc + heads) + 4 * (2 * heads + inner)
    attention = norm(h) + 5 * E * 32 * 128 + 4 * 32
    mlp = norm(h) + 4 * E * 21504
    assert c.mlp_alone and c.experts == 0  # dense: its config's mixture defaults route nothing
    assert memory.stack_activation_bytes(c, BF16) == 24 * mamba + 4 * attention + 24 * mlp


def test_lora_dropout_copies_a_recurrent_layers_inputs():
    """p > 0: a dropped copy (and its 1-byte mask) of the mixer's inputs, 2h, and its output projection's."""
    c = counts_of("Qwen/Qwen3.5-9B")
    extra = memory.stack_activation_bytes(c, BF16, 0.1) - memory.stack_activation_bytes(c, BF16)
    h, h_a, i, values = 4096, 16 * 256, 12288, 32 * 128
    mlp = 2 * h + i
    assert extra == (E + 1) * (24 * (2 * h + values + mlp) + 8 * (3 * h + h_a + mlp))


def test_a_pipeline_stage_counts_the_layers_it_holds():
    """Qwen3.5-9B over 4 stages: each holds 6 gated DeltaNet and 2 attention layers, as the whole model's
    share."""
    c = counts_of("Qwen/Qwen3.5-9B")
    request = PlanRequest(model="Qwen/Qwen3.5-9B", gpus=4, micro_batch=1, global_batch=8)
    pipe = pipeline.Pipe(Mesh("pp", pp=4), "1f1b", chunks=1, micro_batches=8, split=(8, 8, 8, 8))
    held = [pipeline.gpu_counts(c, pipe, index) for index in range(4)]
    assert all(s.mixers.count(("gated DeltaNet",)) == 6 and s.layers == 8 for s in held)
    stages = sum(memory.stack_activation_bytes(s, BF16) for s in held)
    assert stages == memory.stack_activation_bytes(c, BF16) and request.tokens_per_step == 8 * 2048


def _saved_bytes(module, hidden) -> int:
    """Bytes of the distinct storages autograd saves for backward in `module`'s forward, but its weights and
    its input (the layer's norm output, counted as the norm's)."""
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()}
    skip.add(hidden.untyped_storage().data_ptr())
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(hidden)
    return sum(storages.values())


def test_the_short_convolution_keeps_what_the_plan_counts():
    """LFM2's B, C and x, B x, the convolution's output and C times it: 6 x hidden a token (the PyTorch
    convolution's output has kernel - 1 padded positions more, which causal-conv1d's has not)."""
    config = tiny_config("lfm2")
    torch.manual_seed(0)
    conv = next(m for m in Lfm2ForCausalLM(config).modules() if type(m).__name__.endswith(SHORT_CONV.modules))
    tokens, h = 24, config.hidden_size
    hidden = torch.randn(1, tokens, h, requires_grad=True)
    padded = (config.conv_L_cache - 1) * h
    assert SHORT_CONV.kept(config).compute == 6 * h
    assert _saved_bytes(conv, hidden) == 4 * (SHORT_CONV.kept(config).compute * tokens + padded)


def test_plan_shows_the_packed_rows_tokens_per_step(capsys):
    assert cli(["plan", "--model", "Qwen/Qwen3.5-9B", "--packing", "--global-batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "tokens   16 packed rows x 2048 = 32,768 a step, every one an example's" in out
    assert "gated DeltaNet layers start each example from an empty state" in out
    (launch,) = [line.split() for line in out.splitlines() if "accelerate launch" in line]
    assert "data.packing=true" in launch
    assert cli(["plan", "--model", "Qwen/Qwen3.5-9B", "--global-batch", "16"]) == 0
    assert "tokens   at most 16 rows x 2048 = 32,768 a step: each example padded" in capsys.readouterr().out
    assert cli(["plan", "--model", "Qwen/Qwen3.5-9B", "--packing", "--seq-len", "4096", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["tokens_per_step"] == 32 * 4096 and plan["request"]["packing"] is True


def test_packing_is_refused_where_the_recipe_refuses_it(tmp_path):
    with pytest.raises(
        UserError, match="^--packing is for --objective sft: the dpo recipe batches whole rows$"
    ):
        make_plan(PlanRequest(model="Qwen/Qwen3.5-9B", packing=True, objective="dpo"))
    tiny_config("deepseek_v4").save_pretrained(tmp_path)
    with pytest.raises(UserError, match=r"^--packing: .* \(deepseek_v4\) has compressed or sparse-indexed"):
        make_plan(PlanRequest(model=str(tmp_path), packing=True))
