"""The families of 2025-26 (tests/tiny_families.py: tiny random models from transformers' own config
classes), each as a user meets it: the SFT recipe trains it with LoRA from its folder with what LoRA adapts
named and asserted, its checkpoint exports merged and generates; full fine-tuning and QLoRA load and take a
step. Packing and the plan are proven in test_family_packing.py and test_plan_families.py."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest
import torch
from helpers import QUICK
from tiny_families import FAMILIES, tiny_config, tiny_family

from toolkit.commands import cli
from toolkit.config import LoraConfig, ModelConfig
from toolkit.errors import UserError
from toolkit.model import lora_targets, moe, vision
from toolkit.model.families import family_of
from toolkit.model.load import load_model
from toolkit.train.metrics import read_metrics

# What LoRA's default (all-linear) adapts: the layers by their last name, and the tensors adapted as
# parameters (a mixture of experts' fused experts, and linear layers peft's conversion would fuse).
ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP = {"gate_proj", "up_proj", "down_proj"}
DELTA_NET = {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"}
EXPERTS = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
DENSE_AS_TENSORS = {f"mlp.{name}.weight" for name in MLP} | {f"mlp.shared_experts.{n}.weight" for n in MLP}
MLA = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
ADAPTED = {
    "qwen3_5_text": (ATTENTION | MLP | DELTA_NET, set()),
    "qwen3_5_moe_text": (ATTENTION | MLP | DELTA_NET | {"shared_expert_gate"}, EXPERTS),
    "qwen3_next": (
        ATTENTION | {"in_proj_qkvz", "in_proj_ba", "out_proj", "shared_expert_gate"},
        EXPERTS | {f"mlp.shared_expert.{name}.weight" for name in MLP},
    ),
    "llama4_text": (ATTENTION | MLP, {"feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"}),
    "deepseek_v3": (MLA, EXPERTS | DENSE_AS_TENSORS),
    "glm4_moe": (ATTENTION, EXPERTS | DENSE_AS_TENSORS),
    "minimax_m2": (ATTENTION, EXPERTS),
    "olmo3": (ATTENTION | MLP, set()),
    "olmo_hybrid": (ATTENTION | MLP | {"a_proj", "b_proj", "g_proj"}, set()),
    "smollm3": (ATTENTION | MLP, set()),
    "seed_oss": (ATTENTION | MLP, set()),
    "lfm2": ({"q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w2", "w3"}, set()),
    "lfm3": (ATTENTION | {"g_proj", "out_proj", "in_proj", "w1", "w2", "w3"}, set()),
    # Mamba mixers: in_proj adapted, out_proj and conv1d never (peft refuses them on these families).
    "nemotron_h": (
        ATTENTION | {"in_proj", "up_proj", "down_proj"},
        {"mixer.experts.up_proj", "mixer.experts.down_proj"},
    ),
    "falcon_h1": (ATTENTION | MLP | {"in_proj"}, set()),
    "kimi_linear": (
        {"q_proj", "k_proj", "v_proj", "o_proj", "b_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj"}
        | {"kv_a_proj_with_mqa", "kv_b_proj"}
        | MLP,
        EXPERTS,
    ),
    # Its grouped output projection (o_a_proj) is not a plain linear layer: never adapted.
    "deepseek_v4": ({"q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"} | MLP, EXPERTS),
    "gemma4_text": (
        ATTENTION | MLP | {"per_layer_input_gate", "per_layer_projection", "per_layer_model_projection"},
        set(),
    ),
    "mistral4": (MLA | MLP, EXPERTS),
}


def adapted(line: str) -> set[str]:
    return set(line.removeprefix("lora: adapters on ").split(", "))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A family's random model folder, built the first time a test asks and kept for the module: the
    recipe, loading, export and the config check read it, none writes it."""
    built = {}

    def family_folder(family: str):
        if family not in built:
            built[family] = tiny_family(tmp_path_factory.mktemp(f"{family}-model") / "model", family)
        return built[family]

    return family_folder


@pytest.fixture(scope="module")
def trained(recipe, folder, tmp_path_factory):
    """Each family's folder and its LoRA run (2 steps, a checkpoint at step 2; packed rows where the family
    packs), run once and kept, with what the run printed; the families that failed keep their exception."""
    runs = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(family)
        out = io.StringIO()
        try:
            path = folder(family)
            with contextlib.redirect_stdout(out):
                code = recipe.main(
                    [
                        f"output_dir={root / 'run'}",
                        f"model.path={path}",
                        *QUICK,
                        "train.max_steps=2",
                        "train.save_every_steps=2",
                        "eval.max_batches=1",
                        f"data.packing={family_of(tiny_config(family)).keeps_examples_apart}",
                    ]
                )
            runs[family] = (root, code, out.getvalue())
        except Exception as exc:  # noqa: BLE001 - reported by the test of that family
            runs[family] = (root, exc, out.getvalue())
        finally:
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state(reset_partial_state=True)
    return runs


@pytest.mark.usefixtures("signal_handlers_restored")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_recipe_trains_each_family_with_lora_on_the_layers_it_names(trained, family):
    root, code, printed = trained[family]
    assert code == 0, f"{family}: {code!r}\n{printed[-2000:]}"
    losses = [r["loss"] for r in read_metrics(root / "run" / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    line = next(line for line in printed.splitlines() if line.startswith("lora: adapters on "))
    layers, tensors = ADAPTED[family]
    expected = {f"{name} x" for name in layers} | {f"{name} (tensor)" for name in tensors}
    shown = {entry.partition(" x")[0] + " x" if " x" in entry else entry for entry in adapted(line)}
    assert shown == expected, f"{family}: {line}"
    saved = json.loads((root / "run" / "final" / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA"
    kinds = family_of(tiny_config(family)).recurrent
    shown = [line for line in printed.splitlines() if line.startswith("packing: ")]
    assert shown == [f"packing: {family}'s {kind.name} layers run each example on its own" for kind in kinds]


def test_ftkit_export_prints_its_one_line_and_nothing_else(trained, tmp_path):
    """Run as a user runs it: no library's warning, logging line or progress bar before the result."""
    root, code, _ = trained["qwen3_5_text"]
    assert code == 0
    checkpoint, merged = root / "run" / "checkpoints" / "step-2", tmp_path / "merged"
    command = [sys.executable, "-m", "toolkit.commands.cli", "export", str(checkpoint), "--merge-lora"]
    done = subprocess.run([*command, "--out", str(merged)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and len(done.stdout.splitlines()) == 1, done.stdout + done.stderr
    assert str(merged) in done.stdout


@pytest.mark.usefixtures("signal_handlers_restored")
@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h", "deepseek_v4", "gemma4_text", "mistral4"])
def test_a_checkpoint_exports_merged_and_generates(trained, family, tmp_path, capsys):
    root, code, _ = trained[family]
    assert code == 0
    merged = tmp_path / "merged"
    checkpoint = root / "run" / "checkpoints" / "step-2"
    assert cli.main(["export", str(checkpoint), "--merge-lora", "--out", str(merged)]) == 0
    assert (merged / "model.safetensors").is_file() and not (merged / "adapter_config.json").exists()
    capsys.readouterr()
    assert (
        cli.main(["generate", "--model", str(merged), "--prompt", "What is 1 + 2?", "--max-new-tokens", "3"])
        == 0
    )
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("method", ["full", "qlora"])
def test_full_fine_tuning_and_qlora_take_a_step(family, method, folder):
    path = folder(family)
    model = load_model(ModelConfig(path=str(path), method=method, attn_implementation="eager"), LoraConfig())
    ids = torch.randint(5, 2000, (2, 12))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    trained_params = [p for p in model.parameters() if p.requires_grad]
    assert torch.isfinite(loss) and trained_params
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trained_params)
    if method == "qlora":
        assert any(type(m).__name__ == "Linear4bit" for m in model.modules())


def test_a_layer_that_cannot_carry_an_adapter_is_refused_by_name():
    v4 = vision.auto_class("deepseek_v4").from_config(_config("deepseek_v4"))
    with pytest.raises(
        UserError, match=r"o_a_proj cannot carry a LoRA adapter on deepseek_v4 .*not used as a plain"
    ):
        lora_targets.peft_targets(LoraConfig(target_modules=["q_a_proj", "o_a_proj"]), v4)
    nemotron = vision.auto_class("nemotron_h").from_config(_config("nemotron_h"))
    with pytest.raises(UserError, match=r"out_proj cannot carry a LoRA adapter on nemotron_h .*Mamba"):
        lora_targets.peft_targets(LoraConfig(target_modules=["in_proj", "out_proj"]), nemotron)


def test_convolution_weights_are_not_taken_for_experts():
    """A Mamba or short-convolution layer keeps a 3-D weight: neither adapted nor stored in 4-bit as an
    expert."""
    nemotron = vision.auto_class("nemotron_h").from_config(_config("nemotron_h"))
    assert moe.expert_parameter_names(nemotron) == ["mixer.experts.down_proj", "mixer.experts.up_proj"]


def test_mistral4_is_a_text_model_it_loads():
    assert not vision.is_vision("mistral4")
    assert vision.auto_class("mistral4").__name__ == "AutoModelForImageTextToText"
    assert vision.is_vision("gemma4") and vision.is_vision("qwen3_5")


def test_a_family_that_trains_with_dropout_says_losses_follow_the_random_stream(tmp_path):
    """Seed-OSS ships attention and residual dropout 0.1: ftkit trains with it, as its config says, and
    says once that a multi-process run then matches one process only in expectation (the launched
    equality tests build their models with dropout 0, which the same check passes silently)."""
    from toolkit.config import DataConfig, RecipeConfig, TrainConfig
    from toolkit.launch import checks
    from toolkit.launch.machine import Machine
    from toolkit.launch.request import Launch
    from toolkit.model.facts import read_model_facts

    def notes(folder, launch, **overrides):
        _config("seed_oss", **overrides).save_pretrained(folder)
        cfg = RecipeConfig(
            model=ModelConfig(path=str(folder)),
            data=DataConfig(),
            train=TrainConfig(global_batch_size=16, micro_batch_size=2),
        )
        return checks.check_launch(launch, cfg, read_model_facts(cfg.model), "r.yaml", Machine(), {})

    ddp = Launch("ddp", 2, 2, on_cpu=True)
    dropout = [
        n for n in notes(tmp_path / "a", ddp, attention_dropout=0.1, residual_dropout=0.1) if "dropout" in n
    ]
    assert dropout == [
        "the model's config trains with dropout (attention_dropout 0.1, residual_dropout 0.1): each process "
        "draws its own masks, so per-step losses match one process's only in expectation (set the rates to 0 "
        "in its config.json for an exact match)"
    ]
    assert not [
        n
        for n in notes(tmp_path / "b", Launch("single", 1, 1, on_cpu=True), attention_dropout=0.1)
        if "dropout" in n
    ]
    assert not [n for n in notes(tmp_path / "c", ddp) if "dropout" in n]


def _config(family: str, **overrides):
    from tiny_families import tiny_config

    return tiny_config(family, **overrides)


def test_the_shipped_qwen3_5_config_passes_check_config_on_a_qwen3_5_model(tmp_path, folder):
    """recipes/configs/qwen3.5-35b-a3b-lora.yaml with a tiny Qwen3.5 (its text model) in place of the hub
    checkpoint and the embedded data: its launch line's backend passes, packed or not."""
    import yaml
    from helpers import REPO

    from toolkit.commands.check_config import check_config_cli

    raw = yaml.safe_load((REPO / "recipes" / "configs" / "qwen3.5-35b-a3b-lora.yaml").read_text())
    raw["model"]["path"] = str(folder("qwen3_5_text"))
    raw["data"].update(train=str(REPO / "toolkit" / "assets" / "demo" / "train.jsonl"), split="train")
    config = tmp_path / "qwen3.5.yaml"
    config.write_text(yaml.safe_dump(raw))
    accelerate = str(REPO / "accelerate_configs" / "zero3_offload.yaml")
    assert "ok: " in check_config_cli(accelerate, str(config), 2, {})
    raw["data"].update(packing=True, group_by_length=False)
    config.write_text(yaml.safe_dump(raw))
    assert "ok: " in check_config_cli(accelerate, str(config), 2, {})
