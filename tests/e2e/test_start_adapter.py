"""The SFT recipe starts from a trained adapter (`model.adapter`) under ZeRO-3 as it does on one process:
the base is partitioned as it loads, and the start adapter is merged into gathered weights
(`model/load.py`). The DPO recipe's start is proven in test_dpo_recipe.py; GRPO loads through the same
`load_model`."""

import pytest
import torch
from helpers import REPO, launch, run_recipe, train_lines
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from toolkit.train.metrics import read_metrics


@pytest.mark.multiproc
def test_sft_starts_from_an_adapter_under_zero3_like_one_process(tmp_path):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(REPO / "toolkit" / "assets" / "tiny-llama")
    start = get_peft_model(
        base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    start.save_pretrained(tmp_path / "start")
    settings = [f"model.adapter={tmp_path / 'start'}", "train.max_steps=2", "eval.max_batches=0"]
    settings += ["train.global_batch_size=4", "train.micro_batch_size=2"]
    run_recipe(tmp_path / "plain", "train.max_steps=1", "eval.max_batches=0")
    run_recipe(tmp_path / "one", *settings)
    run_recipe(tmp_path / "zero3", *settings, launch=launch("zero3", 2))

    def before(run):
        return next(r for r in read_metrics(tmp_path / run / "metrics.jsonl") if r["step"] == 0)["eval_loss"]

    assert before("one") != pytest.approx(before("plain"), rel=1e-3)  # the start adapter is in the model
    assert before("zero3") == pytest.approx(before("one"), rel=1e-5)
    one, sharded = train_lines(tmp_path / "one"), train_lines(tmp_path / "zero3")
    assert [r["loss"] for r in sharded] == pytest.approx([r["loss"] for r in one], rel=1e-3)
    assert (tmp_path / "zero3" / "final" / "start_adapter" / "adapter_config.json").is_file()
