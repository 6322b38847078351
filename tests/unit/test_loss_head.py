"""The chunked loss head against the model's own logits: the same summed loss and per-sequence log-probs,
the same gradients in float64 (weight, bias, tied embeddings, soft-capped and scaled logits), and no tensor
the size of the whole logits on the way."""

import copy

import pytest
import torch
from helpers import REPO, micro_llama
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaForCausalLM,
)

from toolkit.config import LoraConfig, LossConfig, load_config
from toolkit.errors import UserError
from toolkit.launch import checks
from toolkit.launch.machine import Machine
from toolkit.model.facts import read_model_facts
from toolkit.model.load import _chunked_head, _with_adapter
from toolkit.preference.loss import batch_sequence_logps
from toolkit.train import head
from toolkit.train.loss import IGNORE, batch_loss

VOCAB = 64
SMALL = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
HEADS = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=8)


def labelled_batch(seed=0, rows=4, length=12) -> dict:
    """Rows with prompt positions and right padding ignored, one row with a single label token."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=gen)
    labels = ids.clone()
    labels[:, :3] = IGNORE
    labels[1, 8:] = IGNORE
    labels[2, 5:] = IGNORE
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def pair(model, chunk_tokens=5):
    """(the model as it is, a float64 copy with the chunked head installed) from one float64 model."""
    full = model.double()
    chunked = copy.deepcopy(full)
    head.install(chunked, chunk_tokens)
    return full, chunked


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_summed_loss_and_gradients(full, chunked, batch) -> None:
    """The recipe's summed token loss through the chunked head (gradient taken in forward) against the
    full logits' in float64 (the full path's own summed loss is float32 by design)."""
    expected = -batch_sequence_logps(full, batch)[0].sum()
    got = batch_loss(chunked, batch)
    assert got.item() == pytest.approx(batch_loss(full, batch).item(), rel=1e-6)
    assert got.item() == pytest.approx(expected.item(), rel=1e-12)
    expected.backward()
    got.backward()
    assert_same_gradients(full, chunked)
    full.zero_grad(set_to_none=True)
    chunked.zero_grad(set_to_none=True)


def assert_same_gradients(full, chunked) -> None:
    expected_grads, got_grads = grads(full), grads(chunked)
    assert got_grads.keys() == expected_grads.keys() and expected_grads
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("chunk_tokens", [1, 5, 4096])
def test_summed_loss_and_gradients_equal_the_full_logits_path(chunk_tokens):
    full, chunked = pair(micro_llama(), chunk_tokens)
    batch = labelled_batch()
    assert_same_summed_loss_and_gradients(full, chunked, batch)
    assert_same_sequence_logps_and_gradients(full, chunked, batch)


def assert_same_sequence_logps_and_gradients(full, chunked, batch, weights=(1.0, -2.0, 0.5, 3.0)) -> None:
    """Per-row weights differ, as a preference loss's do: the chunked head must recompute, not scale."""
    weights = torch.tensor(weights, dtype=torch.float64)
    (expected, counts), (got, got_counts) = (
        batch_sequence_logps(full, batch),
        batch_sequence_logps(chunked, batch),
    )
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(got_counts, counts)
    (expected * weights).sum().backward()
    (got * weights).sum().backward()
    assert_same_gradients(full, chunked)


def test_a_summed_loss_takes_its_gradient_in_forward_and_a_weighted_one_recomputes(monkeypatch):
    """Both the early gradient (scaled in backward) and the recomputing fallback give the float64 gradient
    of a uniformly weighted sum; a loss whose token weights differ never gets the early one scaled."""
    calls = []
    real = head._head
    monkeypatch.setattr(head, "_head", lambda *args: calls.append(1) or real(*args))
    full, chunked = pair(micro_llama(), chunk_tokens=5)
    chunked.lm_head.verified = True  # the first call's probe is left out of the count
    batch = labelled_batch()
    labels = int((batch["labels"][:, 1:] != IGNORE).sum())
    head.target_logps(chunked, batch, uniform=True).sum().mul(-3.0).backward()
    assert len(calls) == -(-labels // 5)  # one pass over the chunks: nothing recomputed
    expected = grads(chunked)
    chunked.zero_grad(set_to_none=True)
    head.target_logps(chunked, batch, uniform=False).sum().mul(-3.0).backward()
    assert len(calls) == 3 * -(-labels // 5)  # forward, then each chunk again in backward
    for name, grad in grads(chunked).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-10, atol=1e-12, msg=name)
    # The early gradient asked for, then a non-uniform loss: backward must recompute.
    chunked.zero_grad(set_to_none=True)
    full.zero_grad(set_to_none=True)
    weights = torch.linspace(-1, 2, 4, dtype=torch.float64)
    (head.target_logps(chunked, batch, uniform=True).sum(1) * weights).sum().backward()
    (batch_sequence_logps(full, batch)[0] * weights).sum().backward()
    for name, grad in grads(full).items():
        torch.testing.assert_close(grads(chunked)[name], grad, rtol=1e-10, atol=1e-12, msg=name)


def test_tied_embeddings_get_the_head_and_input_gradients_together():
    full, chunked = pair(micro_llama(tie_word_embeddings=True))
    assert chunked.lm_head.weight is chunked.model.embed_tokens.weight
    assert_same_summed_loss_and_gradients(full, chunked, labelled_batch())
    assert_same_sequence_logps_and_gradients(full, chunked, labelled_batch())


def test_a_head_with_bias_is_scored_with_it():
    model = micro_llama()
    biased = torch.nn.Linear(16, VOCAB, bias=True)
    with torch.no_grad():
        biased.weight.copy_(model.lm_head.weight)
        biased.bias.uniform_(-2, 2)
    model.lm_head = biased
    full, chunked = pair(model)
    assert_same_summed_loss_and_gradients(full, chunked, labelled_batch())
    assert_same_sequence_logps_and_gradients(full, chunked, labelled_batch())
    assert chunked.lm_head.bias.grad.abs().sum() > 0


def test_soft_capped_logits_gemma2_are_scored_exactly_and_the_config_is_restored():
    torch.manual_seed(0)
    config = Gemma2Config(**SMALL, **HEADS, final_logit_softcapping=0.5, attn_implementation="eager")
    full, chunked = pair(Gemma2ForCausalLM(config))
    batch = labelled_batch()
    assert_same_sequence_logps_and_gradients(full, chunked, batch)
    assert chunked.config.final_logit_softcapping == 0.5
    with torch.no_grad():
        logits = chunked(input_ids=batch["input_ids"]).logits
    assert logits.abs().max() <= 0.5  # generation still sees the model's own capped logits


def test_scaled_logits_granite_are_scored_exactly():
    torch.manual_seed(0)
    config = GraniteConfig(
        **SMALL, **{k: v for k, v in HEADS.items() if k != "head_dim"}, logits_scaling=0.25
    )
    full, chunked = pair(GraniteForCausalLM(config))
    assert_same_summed_loss_and_gradients(full, chunked, labelled_batch())
    assert_same_sequence_logps_and_gradients(full, chunked, labelled_batch())
    assert chunked.config.logits_scaling == 0.25


def test_soft_cap_left_to_the_model_would_be_caught():
    """Sensitivity: without moving the cap into the head, the model caps the log-probs and they differ."""
    torch.manual_seed(0)
    config = Gemma2Config(**SMALL, **HEADS, final_logit_softcapping=0.5, attn_implementation="eager")
    full, chunked = pair(Gemma2ForCausalLM(config))
    chunked.lm_head.shape = head.LogitShape(chunked.config, 1.0, None)
    chunked.lm_head.verified = True  # the first call's probe would refuse it (next test)
    with pytest.raises(AssertionError):
        assert_same_sequence_logps_and_gradients(full, chunked, labelled_batch())


class CappedAsAttribute(LlamaForCausalLM):
    """A model that caps its logits after the head from an attribute, announced by no config key."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = 2.0 * torch.tanh(out.logits / 2.0)
        return out


def test_an_unannounced_change_of_the_logits_is_refused_at_first_use_in_one_line():
    torch.manual_seed(0)
    model = CappedAsAttribute(micro_llama().config)
    head.install(model, 8)
    with pytest.raises(UserError) as refused:
        batch_loss(model, labelled_batch())
    message = str(refused.value)
    assert "\n" not in message and "12-token probe" in message and message.endswith("set loss.head: full")
    plain = micro_llama()
    head.install(plain, 8)
    batch_loss(plain, labelled_batch())
    assert plain.lm_head.verified and plain.training  # checked once, training mode restored


def test_models_that_change_logits_otherwise_are_refused_in_one_line():
    torch.manual_seed(0)
    cohere = CohereForCausalLM(CohereConfig(**SMALL, **{k: v for k, v in HEADS.items() if k != "head_dim"}))
    with pytest.raises(UserError) as refused:
        head.install(cohere, 8)
    message = str(refused.value)
    assert "\n" not in message and "cohere" in message and "logit_scale" in message
    assert "loss.head: full" in message


def test_lora_on_the_output_layer_is_refused_in_one_line():
    model = _with_adapter(micro_llama(), LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(
        UserError, match=r"output layer of llama is a peft\.tuners\.lora\.layer\.Linear, .*loss.head: full$"
    ):
        head.install(model, 8)


def test_lora_adapter_gradients_match_through_the_peft_wrapper():
    model = _with_adapter(micro_llama(), LoraConfig(r=2))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    full, chunked = pair(model)
    assert_same_summed_loss_and_gradients(full, chunked, labelled_batch())
    assert_same_sequence_logps_and_gradients(full, chunked, labelled_batch())


class LargestLogitTensor(TorchDispatchMode):
    """Records the largest tensor any operation produces with a vocabulary-sized last dimension, leaving
    out the head's weight and its gradient (the only ones of vocabulary x hidden elements)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight_numel = VOCAB * hidden
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            logit_shaped = isinstance(tensor, torch.Tensor) and VOCAB in tensor.shape[-1:]
            if logit_shaped and tensor.numel() != self.weight_numel:
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("uniform", [True, False])
def test_no_tensor_holds_more_than_one_chunk_of_logits(uniform):
    full, chunked = pair(micro_llama(), chunk_tokens=4)
    chunked.lm_head.verified = True  # the first call's probe takes the logits of 16 tokens, on purpose
    batch = labelled_batch(rows=4, length=24)
    for model, bound in ((chunked, 4 * VOCAB), (full, 4 * 23 * VOCAB)):
        with LargestLogitTensor(hidden=16) as seen:
            head_only = head.target_logps if head.chunked_head(model) else None
            logps = head_only(model, batch, uniform) if head_only else batch_sequence_logps(model, batch)[0]
            logps.sum().backward()
        # The chunked head stays within one chunk; the full path (the check's sensitivity) holds it all.
        assert (seen.largest <= bound) if model is chunked else (seen.largest >= bound)


def test_a_batch_without_label_tokens_gives_zero_loss_and_zero_head_gradient():
    full, chunked = pair(micro_llama())
    batch = labelled_batch()
    batch["labels"][:] = IGNORE
    loss = batch_loss(chunked, batch)
    loss.backward()
    assert loss.item() == 0.0
    assert chunked.lm_head.weight.grad is not None and chunked.lm_head.weight.grad.abs().sum() == 0


def test_under_autocast_the_head_computes_in_bfloat16_like_the_full_path():
    full, chunked = pair(micro_llama())
    full, chunked = full.float(), chunked.float()
    batch = labelled_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = batch_loss(full, batch), batch_loss(chunked, batch)
        expected_logps = batch_sequence_logps(full, batch)[0]
        got_logps = batch_sequence_logps(chunked, batch)[0]
    assert got.item() == pytest.approx(expected.item(), rel=1e-2)
    torch.testing.assert_close(got_logps.float(), expected_logps.float(), rtol=2e-2, atol=5e-2)
    expected.backward()
    got.backward()
    for name, grad in grads(full).items():
        assert grads(chunked)[name].dtype == torch.float32
        torch.testing.assert_close(grads(chunked)[name], grad, rtol=0.1, atol=0.05, msg=name)


def test_outside_scoring_the_head_is_the_plain_layer():
    full, chunked = pair(micro_llama())
    ids = labelled_batch()["input_ids"]
    with torch.no_grad():
        assert torch.equal(full(input_ids=ids).logits, chunked(input_ids=ids).logits)
    assert chunked.state_dict().keys() == full.state_dict().keys()


def test_auto_keeps_the_models_own_head_where_the_chunked_one_cannot_follow_with_one_note(capsys):
    """loss.head auto (the default): the chunked head where it reproduces the logits, else the model's own
    (the same loss) and one line saying why; an explicit `chunked` is refused there instead."""
    torch.manual_seed(0)
    cohere = CohereForCausalLM(CohereConfig(**SMALL, **{k: v for k, v in HEADS.items() if k != "head_dim"}))
    lora_head = _with_adapter(micro_llama(), LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    for model, why in ((cohere, "(logit_scale)"), (lora_head, "not a plain linear layer")):
        _chunked_head(model, LossConfig(head="auto"))
        assert head.chunked_head(model) is None
        (note,) = capsys.readouterr().out.splitlines()
        assert note.startswith("loss.head auto: full logits (") and why in note
        with pytest.raises(UserError, match="set loss.head: full$"):
            _chunked_head(model, LossConfig(head="chunked"))
    plain = micro_llama()
    _chunked_head(plain, LossConfig(head="auto"))
    assert head.chunked_head(plain) is plain.lm_head and capsys.readouterr().out == ""


def test_the_launch_check_refuses_such_a_model_before_any_data_is_read(tmp_path):
    CohereConfig(**SMALL, num_attention_heads=2, num_key_value_heads=1).save_pretrained(tmp_path)
    cfg = load_config(None, [f"model.path={tmp_path}"])
    launch = checks.launch_from_yaml(REPO / "accelerate_configs" / "single.yaml", gpu_count=0)
    facts = read_model_facts(cfg.model)
    assert checks.check_launch(launch, cfg, facts, "recipe.yaml", Machine(), {}) == []  # auto: full logits
    cfg.loss.head = "chunked"
    with pytest.raises(UserError) as refused:
        checks.check_launch(launch, cfg, read_model_facts(cfg.model), "recipe.yaml", Machine(), {})
    assert "\n" not in str(refused.value)
    assert str(refused.value).startswith("loss.head chunked in recipe.yaml: ")
    assert "(logit_scale)" in str(refused.value)
    cfg.loss.head = "full"
    assert checks.check_launch(launch, cfg, read_model_facts(cfg.model), "recipe.yaml", Machine(), {}) == []


def test_the_scored_output_is_a_tensor_of_its_own_not_a_view():
    """FSDP2 hooks the root module's outputs for backward and warns (on the console) about a view."""
    _, chunked = pair(micro_llama())
    batch = labelled_batch()
    chunked.lm_head.targets = batch["labels"]
    try:
        out = chunked(input_ids=batch["input_ids"]).logits
    finally:
        chunked.lm_head.targets = None
    assert out.shape == batch["labels"].shape and out._base is None


def test_a_frozen_head_is_never_recomputed_whatever_the_loss(monkeypatch):
    """LoRA leaves the head frozen: the hidden states' gradient, taken in forward per row, is all that is
    needed, also for a preference loss's per-pair weights; it equals the full path's in float64."""
    calls = []
    real = head._head
    monkeypatch.setattr(head, "_head", lambda *args: calls.append(1) or real(*args))
    model = _with_adapter(micro_llama(), LoraConfig(r=2))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    full, chunked = pair(model, chunk_tokens=5)
    chunked.lm_head.verified = True  # the first call's probe is left out of the count
    batch = labelled_batch()
    labels = int((batch["labels"][:, 1:] != IGNORE).sum())
    calls.clear()
    assert_same_sequence_logps_and_gradients(full, chunked, batch)
    assert len(calls) == -(-labels // 5)  # the forward pass's chunks only
