"""The launch check reads the model's config once and hands what it learned to every check."""

import dataclasses
from pathlib import Path

import pytest
from helpers import REPO
from transformers import MixtralConfig

from toolkit.config import ModelConfig, load_config
from toolkit.errors import UserError
from toolkit.launch.backend import with_pipeline
from toolkit.launch.checks import check_launch, launch_from_yaml
from toolkit.launch.machine import Machine
from toolkit.model import facts

TINY = str(REPO / "toolkit" / "assets" / "tiny-llama")


def test_the_facts_of_the_embedded_model():
    got = facts.read_model_facts(ModelConfig(path=TINY))
    assert (got.model_type, got.num_layers, got.experts) == ("llama", 4, 0)
    assert {"LlamaDecoderLayer", "LlamaAttention"} <= got.module_classes
    assert got.tp_plan and got.raw["hidden_size"] == 160


def test_an_mixture_of_experts_says_so_and_remote_code_reads_only_the_json(tmp_path):
    MixtralConfig(hidden_size=64, num_hidden_layers=2, num_local_experts=4, vocab_size=128).save_pretrained(
        tmp_path
    )
    assert facts.read_model_facts(ModelConfig(path=str(tmp_path))).experts == 4
    remote = facts.read_model_facts(ModelConfig(path=str(tmp_path), trust_remote_code=True))
    assert remote.config is None and remote.module_classes is None and remote.experts == 4


def test_an_unreadable_path_gives_unknown_facts(tmp_path):
    unknown = facts.read_model_facts(ModelConfig(path=str(tmp_path)))
    assert (unknown.config, unknown.raw, unknown.module_classes, unknown.experts) == (None, None, None, 0)


def test_the_checks_read_nothing_more_than_the_facts_they_are_given(tmp_path, monkeypatch):
    """A pipeline launch, the chunked head, QLoRA's widths and an FSDP wrap class all need the config:
    with the facts read first, the checks themselves never read it again."""
    pipeline = load_config(None, [f"model.path={TINY}", "pipeline.size=2", "train.micro_batch_size=4"])
    qlora = load_config(None, [f"model.path={TINY}", "model.method=qlora"])
    known = facts.read_model_facts(pipeline.model)

    def refused(*args, **kwargs):
        raise AssertionError("the config was read again")

    launch = with_pipeline(launch_from_yaml(REPO / "accelerate_configs" / "pp.yaml", 0), 2, "recipe.yaml")
    single = launch_from_yaml(REPO / "accelerate_configs" / "single.yaml", 0)
    plain = load_config(None, [f"model.path={TINY}"])
    monkeypatch.setattr(facts.AutoConfig, "from_pretrained", refused)
    monkeypatch.setattr(Path, "read_text", refused)
    assert check_launch(launch, pipeline, known, "recipe.yaml", Machine(), {}) == []
    with pytest.raises(UserError, match="hidden_size 160 is not a multiple of the 4-bit block size 64"):
        check_launch(single, qlora, known, "recipe.yaml", Machine(), {})
    fsdp = dataclasses.replace(single, backend="fsdp", fsdp_version=2)
    fsdp.fsdp_settings.update(transformer_layer_cls_to_wrap="NotALayer")
    with pytest.raises(UserError, match="NotALayer is not a layer of .*: use LlamaDecoderLayer"):
        check_launch(fsdp, plain, known, "recipe.yaml", Machine(), {})


def test_moe_keys_on_a_dense_model_are_one_line():
    cfg = load_config(None, [f"model.path={TINY}", "moe.router_aux_loss_coef=0.01"])
    single = launch_from_yaml(REPO / "accelerate_configs" / "single.yaml", 0)
    with pytest.raises(
        UserError, match=r"^moe.router_aux_loss_coef in recipe.yaml: .*tiny-llama \(llama\) is not"
    ):
        check_launch(single, cfg, facts.read_model_facts(cfg.model), "recipe.yaml", Machine(), {})
    cfg = load_config(None, [f"model.path={TINY}", "moe.experts_implementation=eager"])
    with pytest.raises(UserError, match=r"^moe.experts_implementation in recipe.yaml: .*is not a mixture"):
        check_launch(single, cfg, facts.read_model_facts(cfg.model), "recipe.yaml", Machine(), {})
    with pytest.raises(UserError, match="moe.router_aux_loss_coef: must be"):
        load_config(None, ["moe.router_aux_loss_coef=-1"])
    with pytest.raises(UserError, match="moe.experts_implementation: .*grouped_mm"):
        load_config(None, ["moe.experts_implementation=loop"])


def test_expert_parallelism_is_checked_against_the_launch_the_model_and_the_method(tmp_path):
    """Every refusal is one line naming the key; a split that works passes."""
    from helpers import tiny_moe_config

    tiny_moe_config("qwen3_moe").save_pretrained(tmp_path)
    ep = launch_from_yaml(REPO / "accelerate_configs" / "ep.yaml", 0)
    fsdp = launch_from_yaml(REPO / "accelerate_configs" / "fsdp.yaml", 0)

    def check(launch, *overrides):
        cfg = load_config(None, [f"model.path={tmp_path}", "model.method=full", *overrides])
        return check_launch(launch, cfg, facts.read_model_facts(cfg.model), "recipe.yaml", Machine(), {})

    assert check(ep, "moe.expert_parallel=2") == []
    assert check(ep, "moe.expert_parallel=2", "model.method=lora", "lora.experts=false") == []
    refusals = {
        "fsdp2": (fsdp, ["moe.expert_parallel=2"], "plain multi-process launch .*not under fsdp2"),
        "world": (ep, ["moe.expert_parallel=4"], "every process; 2 were launched"),
        "lora": (ep, ["moe.expert_parallel=2", "model.method=lora"], "lora with lora.experts"),
    }
    for launch, overrides, message in refusals.values():
        with pytest.raises(UserError, match=rf"^moe.expert_parallel \d in recipe.yaml: .*{message}"):
            check(launch, *overrides)
    odd = tmp_path / "odd"
    tiny_moe_config("qwen3_moe", num_experts=3).save_pretrained(odd)
    with pytest.raises(UserError, match="3 experts a layer do not split 2 ways"):
        check(ep, f"model.path={odd}", "moe.expert_parallel=2")
    cfg = load_config(None, [f"model.path={TINY}", "moe.expert_parallel=2"])
    dense = r"^moe.expert_parallel in recipe.yaml: .*is not a mixture of experts"
    with pytest.raises(UserError, match=dense):
        check_launch(ep, cfg, facts.read_model_facts(cfg.model), "recipe.yaml", Machine(), {})
