"""toolkit/assets/tiny-llama-h80, the engine demo's base (scripts/widen_heads.py): the demo model with its
attention heads widened from 40 (which vLLM's CPU engine refuses) to 80, computing the same logits, and
the demo's start adapter widened with it computing the same logits too."""

import importlib.util
import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[2]
TINY, WIDE = REPO / "toolkit" / "assets" / "tiny-llama", REPO / "toolkit" / "assets" / "tiny-llama-h80"


def script():
    spec = importlib.util.spec_from_file_location("widen_heads", REPO / "scripts" / "widen_heads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prompts() -> torch.Tensor:
    return torch.randint(0, 2048, (3, 40), generator=torch.Generator().manual_seed(0))


def test_the_widened_model_is_the_demo_model_with_heads_the_engine_serves(tmp_path):
    assert json.loads((WIDE / "config.json").read_text())["head_dim"] == 80
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (WIDE / name).read_bytes() == (TINY / name).read_bytes()
    script().widen_model(tmp_path / "rebuilt")
    rebuilt, shipped = (
        load_file(tmp_path / "rebuilt" / "model.safetensors"),
        load_file(WIDE / "model.safetensors"),
    )
    assert rebuilt.keys() == shipped.keys() and all(torch.equal(rebuilt[k], shipped[k]) for k in shipped)
    with torch.no_grad():
        narrow = AutoModelForCausalLM.from_pretrained(TINY)(input_ids=prompts()).logits
        wide = AutoModelForCausalLM.from_pretrained(WIDE)(input_ids=prompts()).logits
    # Float rounding only (the queries scaled by sqrt(2), sums in another order): 1e-5 of logits up to ~18.
    torch.testing.assert_close(wide, narrow, rtol=0, atol=1e-4)


def test_a_start_adapter_widened_computes_what_it_did(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(TINY)
    adapted = get_peft_model(base, LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))
    adapted.save_pretrained(str(tmp_path / "narrow"))
    script().widen_adapter(tmp_path / "narrow", tmp_path / "wide")
    widened = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(WIDE), str(tmp_path / "wide"))
    with torch.no_grad():
        before, plain = (
            adapted(input_ids=prompts()).logits,
            AutoModelForCausalLM.from_pretrained(TINY)(input_ids=prompts()).logits,
        )
        after = widened(input_ids=prompts()).logits
    assert (before - plain).abs().max() > 1.0  # the adapter changes the logits
    torch.testing.assert_close(after, before, rtol=0, atol=1e-4)
    assert json.loads((tmp_path / "wide" / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        "toolkit/assets/tiny-llama-h80"
    )


def test_a_fresh_adapter_widened_trains_as_it_does_on_the_demo_model(tmp_path):
    """lora.init_adapter from `widen_heads.py --fresh-lora SEED`: the same adapter a run with SEED draws on
    tiny-llama, and three Adam steps on the widened model give the logits three steps give on tiny-llama."""
    from toolkit.config import LoraConfig, ModelConfig
    from toolkit.model.load import load_model

    script().widen_fresh_lora(7, tmp_path / "fresh")
    torch.manual_seed(7)
    narrow = load_model(ModelConfig(path=str(TINY), attn_implementation="eager"), LoraConfig())
    torch.manual_seed(123)  # the continued adapter draws nothing
    wide = load_model(
        ModelConfig(path=str(WIDE), attn_implementation="eager"),
        LoraConfig(init_adapter=str(tmp_path / "fresh")),
    )
    assert sum(p.numel() for p in wide.parameters() if p.requires_grad) > 0
    ids = prompts()
    for model in (narrow, wide):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    with torch.no_grad():
        trained, widened = narrow(input_ids=ids).logits, wide(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(TINY)(input_ids=ids).logits
    assert (trained - plain).abs().max() > 0.5  # the steps moved the adapter
    torch.testing.assert_close(widened, trained, rtol=0, atol=1e-3)


def test_an_init_adapter_that_does_not_match_the_config_is_one_line(tmp_path):
    from toolkit.config import LoraConfig, ModelConfig
    from toolkit.errors import UserError
    from toolkit.model.load import load_model

    script().widen_fresh_lora(7, tmp_path / "fresh")
    cases = {
        "lora.r is 8, the adapter at lora.init_adapter": LoraConfig(
            r=8, init_adapter=str(tmp_path / "fresh")
        ),
        "not an adapter directory": LoraConfig(init_adapter=str(tmp_path)),
    }
    for words, lora in cases.items():
        try:
            load_model(ModelConfig(path=str(WIDE)), lora)
        except UserError as exc:
            assert words in str(exc) and "\n" not in str(exc)
        else:
            raise AssertionError(f"{lora} was accepted")


def test_a_folder_the_script_did_not_write_is_left_alone(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    try:
        script().widen_fresh_lora(7, tmp_path / "mine")
    except SystemExit as exc:
        assert "not an adapter this script wrote" in str(exc)
    else:
        raise AssertionError("a user's folder was written into")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    script().widen_fresh_lora(7, tmp_path / "ours")
    script().widen_fresh_lora(7, tmp_path / "ours")  # its own output is rewritten
