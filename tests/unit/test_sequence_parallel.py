"""Ulysses sequence parallelism in one process: how a batch is cut into the ranks' slices, and what a launch
with parallelism_config_sp_size is refused, in one line each (tests/e2e/test_sequence_parallel.py trains)."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from helpers import REPO, write_yaml

from toolkit.config import RecipeConfig, TrainConfig, load_config
from toolkit.errors import UserError
from toolkit.launch import backend, checks
from toolkit.launch.machine import Machine
from toolkit.launch.request import backend_name, batch_split
from toolkit.model.facts import ModelFacts
from toolkit.model.facts import read_model_facts as facts_of
from toolkit.train import loss
from toolkit.train.sequence_parallel import SequenceSplit

SP = REPO / "accelerate_configs" / "sp.yaml"
SP_DP = REPO / "accelerate_configs" / "sp_dp.yaml"


def rank_split(rank: int, size: int = 2) -> SequenceSplit:
    """The split as rank `rank` of a group of `size` holds it, without a process group (cut needs none)."""
    split = SequenceSplit.__new__(SequenceSplit)
    split.size, split.rank = size, rank
    return split


def batch() -> dict:
    """Two right-padded rows of 7 tokens (prompt masked in the first): the cut must pad them to 8."""
    ids = torch.arange(1, 15).reshape(2, 7)  # token ids below 16, the test logits' vocabulary
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, 5:] = -100
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def test_the_slices_hold_the_shifted_labels_and_global_positions_of_whole_rows():
    whole = batch()
    pieces = [rank_split(rank).cut(dict(whole)) for rank in (0, 1)]
    assert [p["input_ids"].shape for p in pieces] == [torch.Size([2, 4])] * 2
    joined = {key: torch.cat([p[key] for p in pieces], dim=1) for key in ("input_ids", "shift_labels")}
    assert torch.equal(joined["input_ids"][:, :7], whole["input_ids"])
    # A slice's last position predicts the next slice's first token: shifted before the cut.
    assert torch.equal(joined["shift_labels"][:, :6], whole["labels"][:, 1:])
    assert (joined["shift_labels"][:, 6:] == -100).all()
    assert torch.equal(pieces[1]["position_ids"], torch.arange(4, 8).expand(2, -1))
    assert "labels" not in pieces[0]
    # Every target counted once over the group; the rows once, on the group's first rank.
    assert sum(loss.batch_targets(p) for p in pieces) == loss.count_targets(whole["labels"])
    assert [p["rows"] for p in pieces] == [2, 0]


def test_the_slices_losses_add_up_to_the_whole_rows_loss():
    """With the logits of whole rows cut like the batch (what Ulysses attention gives each rank), the
    slices' summed losses are the unsplit summed loss."""
    whole = batch()
    logits = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    expected = loss.summed_token_loss(logits[:, :7], whole["labels"])

    class Slice(torch.nn.Module):
        def __init__(self, rank: int):
            super().__init__()
            self.rank = rank

        def forward(self, **_):
            return SimpleNamespace(logits=logits[:, 4 * self.rank : 4 * (self.rank + 1)])

    total = sum(loss.batch_loss(Slice(rank), rank_split(rank).cut(dict(whole))) for rank in (0, 1))
    torch.testing.assert_close(total, expected)


def launch_of(path, gpus: int = 0):
    return checks.launch_from_yaml(path.relative_to(REPO) if path.is_relative_to(REPO) else path, gpus)


def check(path, cfg=None, facts=None, env=None):
    cfg = cfg or RecipeConfig(train=TrainConfig(global_batch_size=16, micro_batch_size=2))
    return checks.check_launch(
        launch_of(path), cfg, facts or facts_of(cfg.model), "recipe.yaml", Machine(), env or {}
    )


def test_the_shipped_configs_name_their_layout(monkeypatch):
    monkeypatch.chdir(REPO)
    sp, both = launch_of(SP), launch_of(SP_DP)
    assert (sp.mesh.sp, sp.mesh.data_parallel, backend_name(sp)) == (2, 1, "sp 2")
    assert (both.mesh.sp, both.mesh.data_parallel, backend_name(both)) == (2, 2, "sp 2 x dp 2")
    assert batch_split(both) == "data-parallel 2 (world 4 / sp 2)"


def test_sp_zero3_is_the_launch_of_accelerates_guide_yaml_that_the_e2e_tests_train(monkeypatch):
    monkeypatch.chdir(REPO)
    shipped = launch_of(REPO / "accelerate_configs" / "sp_zero3.yaml")
    guide = launch_of(REPO / "tests" / "e2e" / "peer_configs" / "accelerate_docs_sp.yaml")
    assert dataclasses.replace(shipped, source=guide.source) == guide
    assert (guide.zero_stage, guide.mesh.sp, guide.world_size) == (3, 2, 2)


def test_the_accelerator_gets_deepspeeds_sequence_parallel_settings(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION", raising=False)
    kwargs = backend.accelerator_kwargs(launch_of(SP_DP), TrainConfig(), grad_accum_steps=2)
    config = kwargs["parallelism_config"]
    assert (config.sp_size, config.sp_backend, config.dp_shard_size) == (2, "deepspeed", 2)
    assert config.sp_handler.sp_seq_length_is_variable and config.sp_handler.sp_attn_implementation == "sdpa"
    # ZeRO-3's sharded construction checks the global batch against the data-parallel processes.
    assert kwargs["deepspeed_plugin"].deepspeed_config["sequence_parallel_size"] == 2


def preference(**dpo) -> RecipeConfig:
    from toolkit.preference.config import DpoConfig, PreferenceConfig

    return PreferenceConfig(train=TrainConfig(global_batch_size=16, micro_batch_size=2), dpo=DpoConfig(**dpo))


def grpo() -> RecipeConfig:
    from toolkit.grpo.config import GrpoRecipeConfig

    return GrpoRecipeConfig(train=TrainConfig(global_batch_size=16, micro_batch_size=2))


def test_preference_tuning_runs_with_a_precomputed_or_no_reference(monkeypatch):
    monkeypatch.chdir(REPO)
    assert check(SP_DP, preference(precompute_reference=True)) == []
    assert check(SP_DP, preference(loss="simpo")) == []


@pytest.mark.parametrize("reference", ["", "some/reference"], ids=["adapter-off", "separate"])
def test_a_live_reference_is_precomputed_with_one_note(reference, monkeypatch):
    """The reference never trains, so its log-probs on whole rows before training are the live ones:
    ftkit sets the key itself rather than refusing."""
    monkeypatch.chdir(REPO)
    cfg = preference(reference_model=reference)
    notes = check(SP_DP, cfg)
    assert cfg.dpo.precompute_reference
    assert len(notes) == 1 and notes[0].startswith("dpo.precompute_reference: on (sp 2 splits each row")
    assert ("dpo.reference_model" if reference else "the adapter switched off") in notes[0]


def sft(*keys: str) -> RecipeConfig:
    return load_config(None, ["train.global_batch_size=16", "train.micro_batch_size=2", *keys])


@pytest.mark.parametrize(
    "cfg, env, message",
    [
        (grpo, {}, "runs the SFT and preference recipes; the grpo recipe is refused"),
        (lambda: sft("data.packing=true"), {}, "refuses data.packing"),
        (lambda: sft("data.streaming=true"), {}, "refuses data.streaming"),
        (lambda: sft("model.attn_implementation=eager"), {}, "refuses model.attn_implementation eager"),
        (
            sft,
            {"PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION": "flash_attention_2"},
            "refuses model.attn_implementation auto with the launch's sp attention flash_attention_2",
        ),
        (lambda: sft("train.micro_batch_size=8"), {}, r"not divisible by train.micro_batch_size \(8\) x 4"),
    ],
)
def test_what_sequence_parallelism_cannot_run_is_refused_in_one_line(cfg, env, message, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(UserError, match=message):
        check(SP_DP, cfg(), env=env)


def test_heads_that_do_not_divide_are_refused(monkeypatch):
    monkeypatch.chdir(REPO)
    facts = ModelFacts("m", raw={"num_attention_heads": 6, "num_key_value_heads": 3})
    with pytest.raises(UserError, match="6 attention heads and 3 key/value heads; .* divisible by 2"):
        check(SP, facts=facts)
    # Fewer key/value heads than the group: DeepSpeed repeats them, so 4 heads sharing 1 split in two.
    assert check(SP, facts=ModelFacts("m", raw={"num_attention_heads": 4, "num_key_value_heads": 1})) == []


def test_other_backends_and_zero3_without_reduce_scatter_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    sizes = {"parallelism_config_sp_size": 2}
    fsdp = write_yaml(
        tmp_path,
        {
            "distributed_type": "FSDP",
            "num_processes": 2,
            "fsdp_config": {"fsdp_version": 2},
            "parallelism_config": sizes,
        },
        "fsdp_sp.yaml",
    )
    with pytest.raises(UserError, match="sp_size 2 needs distributed_type: DEEPSPEED"):
        check(fsdp)
    zero3 = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    zero3["zero_optimization"]["reduce_scatter"] = False
    (tmp_path / "z3.json").write_text(json.dumps(zero3))
    section = {"deepspeed_config_file": str(tmp_path / "z3.json")}
    no_scatter = write_yaml(
        tmp_path,
        {
            "distributed_type": "DEEPSPEED",
            "num_processes": 2,
            "deepspeed_config": section,
            "parallelism_config": sizes,
        },
        "z3_sp.yaml",
    )
    with pytest.raises(UserError, match="refuses zero_optimization.reduce_scatter false"):
        check(no_scatter)
