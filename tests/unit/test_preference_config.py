from pathlib import Path

import pytest

from toolkit.errors import UserError
from toolkit.preference.config import (
    PreferenceConfig,
    load_preference_config,
    precomputes_reference,
    prompt_budget,
)
from toolkit.train.batches import grad_accum_steps
from toolkit.typed_yaml import field_docs

REPO = Path(__file__).resolve().parents[2]
SHIPPED_DPO = sorted((REPO / "recipes" / "configs").rglob("*dpo*.yaml"))


@pytest.mark.parametrize("path", SHIPPED_DPO, ids=lambda p: p.name)
def test_every_shipped_preference_config_loads(path):
    cfg = load_preference_config(path, [])
    assert cfg.dpo.loss in ("sigmoid", "ipo", "simpo", "orpo")
    assert grad_accum_steps(cfg.train, 2) >= 1


def test_no_config_means_the_preference_demo():
    cfg = load_preference_config(None, [])
    assert cfg.output_dir == "runs/demo-dpo" and cfg.model.adapter == "runs/demo/final"


def test_every_dpo_key_is_documented():
    docs = field_docs(PreferenceConfig)
    for key in (
        "loss",
        "beta",
        "simpo_gamma",
        "sft_weight",
        "max_prompt_length",
        "reference_model",
        "precompute_reference",
    ):
        assert docs[f"dpo.{key}"].strip()
    assert docs["model.adapter"].strip()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["dpo.los=ipo"], "unknown key dpo.los (did you mean dpo.loss?)"),
        (["dpo.loss=cpo"], "dpo.loss: 'cpo' is not one of sigmoid, ipo, simpo, orpo, kto"),
        (
            ["dpo.loss=kto"],
            "demo-dpo.yaml) weighs a chosen answer's NLL, and KTO's rows are desirable or not",
        ),
        (["dpo.loss=kto"], "with no chosen answer: add dpo.sft_weight=null"),
        (["dpo.loss=kto", "dpo.sft_weight=2"], "dpo.sft_weight: 2.0 (set in the command line)"),
        (["dpo.loss=kto", "dpo.sft_weight=null", "pipeline.size=2"], "pipeline.size: dpo.loss kto"),
        (["dpo.beta=0"], "dpo.beta: must be positive"),
        (["dpo.beta=high"], "dpo.beta has the wrong type"),
        (["dpo.max_prompt_length=64"], "dpo.max_prompt_length: must be in [0, data.max_length=64)"),
        (["data.packing=true"], "data.packing is for SFT; pairs are batched whole"),
        (["dpo.loss=kto", "dpo.sft_weight=null", "data.packing=true"], "data.packing is for SFT"),
        (["data.streaming=true"], "data.streaming is for SFT (it packs rows); pairs are read whole"),
        (["dpo.sft_weight=-1"], "dpo.sft_weight"),
        (["dpo.reference_model=/no/such/ref"], "dpo.reference_model: /no/such/ref does not exist"),
        (["dpo.loss=orpo", "dpo.reference_model=x"], "dpo.loss orpo uses no reference model"),
        (["model.method=qlora"], "model.adapter cannot be merged into a 4-bit base"),
    ],
)
def test_bad_preference_settings_name_the_key(overrides, message):
    with pytest.raises(UserError, match=None) as caught:
        load_preference_config(None, overrides)
    assert message in str(caught.value)


def test_reference_choice_follows_method_and_loss():
    cfg = load_preference_config(None, [])
    assert not precomputes_reference(cfg) and prompt_budget(cfg) == 32
    assert precomputes_reference(load_preference_config(None, ["model.method=full"]))
    assert not precomputes_reference(
        load_preference_config(None, ["model.method=full", "dpo.reference_model=x"])
    )
    assert not precomputes_reference(load_preference_config(None, ["model.method=full", "dpo.loss=simpo"]))
