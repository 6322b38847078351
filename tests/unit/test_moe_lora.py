"""LoRA's reach on a mixture of experts: `lora.experts: false` keeps the adapters off the routed experts,
or, where peft would adapt them all the same, says so in one line."""

import pytest
from helpers import tiny_moe

from toolkit.config import LoraConfig, ModelConfig
from toolkit.errors import UserError
from toolkit.model import moe
from toolkit.model.load import load_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_lora_experts_false_keeps_the_experts_frozen_or_refuses_in_one_line(tmp_path):
    path = str(tiny_moe(tmp_path / "moe"))
    lora = ModelConfig(path=path, method="lora")
    listed = load_model(lora, LoraConfig(experts=False, target_modules=ATTENTION))
    assert set(moe.trained_parts(listed)) == {"attention"}
    # all-linear includes the experts' former linear layers, which peft maps onto the fused tensors
    with pytest.raises(UserError, match=r"^lora.experts: false cannot keep peft off .* qwen3_moe: list the"):
        load_model(lora, LoraConfig(experts=False))
