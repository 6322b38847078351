"""Training FLOPs per token: the formula against a hand count and against torch's FLOP counter."""

import pytest
import torch
from helpers import tiny_llama_config
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaForCausalLM

from toolkit.model.flops import ModelShape, flops_per_token, mfu, peak_flops, training_flops_per_token
from toolkit.plan.counts import count_parameters
from toolkit.train.metrics import StepSpeed

SEQ = 4
# 2 layers, hidden 8, 2 heads of 4, 1 key/value head (k and v project 8 -> 4), MLP width 16, vocab 32.
CONFIG = dict(
    vocab_size=32,
    hidden_size=8,
    intermediate_size=16,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=16,
    attn_implementation="eager",
)
# Every matrix multiplication of one layer, (in, out) of its weight.
LAYER_MATMULS = {
    "q": (8, 8),
    "k": (8, 4),
    "v": (8, 4),
    "o": (8, 8),
    "gate": (8, 16),
    "up": (8, 16),
    "down": (16, 8),
}
HEAD = (8, 32)


def hand_count(lora_r: int | None) -> int:
    """Per token: each weight costs 2 FLOPs forward and 2 for the input gradient, a trainable one 2 more for
    its weight gradient; attention scores (QK^T) and outputs (AV) cost 2 * seq * (heads x head_dim) each."""
    frozen = trainable = 0
    for fan_in, fan_out in [*LAYER_MATMULS.values()] * 2 + [HEAD]:
        if lora_r is None:
            trainable += fan_in * fan_out
        else:
            frozen += fan_in * fan_out
            if (fan_in, fan_out) != HEAD:  # all-linear LoRA leaves the output head alone
                trainable += fan_in * lora_r + lora_r * fan_out
    attention_forward = 2 * (2 * SEQ * 8)
    return 4 * frozen + 6 * trainable + 3 * attention_forward * 2


def test_full_fine_tune_matches_hand_count_and_is_6n_plus_attention():
    counts = count_parameters(tiny_llama_config(**CONFIG), "full", lora_r=2)
    assert counts.matmul_trainable == 1408 and counts.matmul_frozen == 0
    assert flops_per_token(counts, SEQ) == hand_count(None) == 6 * 1408 + 12 * 2 * SEQ * 8 == 9216


def test_lora_matches_hand_count():
    counts = count_parameters(tiny_llama_config(**CONFIG), "lora", lora_r=2)
    assert (counts.matmul_frozen, counts.matmul_trainable) == (1408, 512)
    assert flops_per_token(counts, SEQ) == hand_count(2) == 9472


def _measured_per_token(model) -> float:
    batch = torch.randint(0, 32, (3, SEQ))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=batch).logits.sum().backward()
    return counter.get_total_flops() / batch.numel()


def test_torch_flop_counter_agrees_for_full_fine_tuning():
    torch.manual_seed(0)
    assert _measured_per_token(LlamaForCausalLM(tiny_llama_config(**CONFIG))) == 9216


@pytest.mark.filterwarnings("ignore::FutureWarning")  # raised inside peft, about transformers
def test_torch_flop_counter_agrees_for_lora_up_to_the_first_layers_input_gradient():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(
        LlamaForCausalLM(tiny_llama_config(**CONFIG)), LoraConfig(r=2, target_modules="all-linear")
    )
    # Layer 0's q, k and v read the frozen embeddings: autograd skips their input gradient (base and lora_A).
    skipped = 2 * sum(
        fan_in * fan_out + fan_in * 2
        for fan_in, fan_out in (LAYER_MATMULS["q"], LAYER_MATMULS["k"], LAYER_MATMULS["v"])
    )
    assert _measured_per_token(model) == 9472 - skipped


def test_raw_formula():
    assert training_flops_per_token(10, 0, 0, 0, 0) == 40
    assert training_flops_per_token(0, 10, 1, 1, 1) == 60 + 12


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA GeForce RTX 4090", 165e12),
        ("NVIDIA GeForce RTX 3090", 71e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA RTX A6000", 155e12),
        ("NVIDIA H200", 989e12),
        ("cpu", None),
        ("Some Future GPU", None),
    ],
)
def test_peak_table(name, peak):
    assert peak_flops(name) == peak


def test_mfu():
    # 2 RTX 4090s at 2,000 tokens/s and 33e9 FLOPs per token: 66e12 of 330e12.
    assert mfu(2000, 33_000_000_000, "NVIDIA GeForce RTX 4090", 2) == pytest.approx(0.2)
    assert mfu(2000, 33_000_000_000, "cpu", 1) is None
    assert mfu(2000, 33_000_000_000, None, 1) is None


@pytest.mark.parametrize("method", ["full", "lora"])
def test_shape_of_a_loaded_model_gives_the_counted_flops(method):
    from peft import LoraConfig, get_peft_model

    model = LlamaForCausalLM(tiny_llama_config(**CONFIG))
    if method == "lora":
        model = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert ModelShape.of(model).flops_per_token(SEQ) == hand_count(None if method == "full" else 2)


def test_step_speed_reports_mfu_only_for_a_known_device():
    shape = ModelShape(matmul_frozen=0, matmul_trainable=1408, layers=2, attn_dim=8)
    speed = StepSpeed(shape, torch.device("cpu"), world_size=2)
    values = speed.measure(tokens=4000, rows=1000, elapsed=2.0, data_wait=0.5)
    assert values["tokens_per_s"] == 2000 and values["tokens_per_s_per_device"] == 1000
    assert values["data_wait_frac"] == 0.25 and "mfu" not in values
    speed.device_name = "NVIDIA GeForce RTX 4090"  # what torch.cuda.get_device_name reports there
    # 2000 tokens/s x 9216 FLOPs (rows of 4 tokens: the attention term at SEQ) over 2 x 165 TFLOP/s.
    assert speed.measure(4000, 1000, 2.0, 0.5)["mfu"] == pytest.approx(2000 * 9216 / (2 * 165e12))
