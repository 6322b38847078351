"""One distribution: at a sampling temperature T the trainer's log-prob of each sampled token (policy,
reference, teacher and the chunked head alike) is that of softmax(logits / T), the distribution HF generate's
seeded sampler drew it from; with a top-k / top-p cut, the cut's renormalised log-probs (what an engine
returns, compared with them) are the sampler's too. The engine's side is tests/e2e/test_grpo_engine.py's."""

import copy

import pytest
import torch
from helpers import micro_llama
from transformers import Gemma2Config, Gemma2ForCausalLM, LogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

from toolkit.data.encode import IGNORE
from toolkit.grpo import loss as grpo_loss
from toolkit.grpo import rollout as rollouts
from toolkit.grpo import sampling
from toolkit.grpo.config import GrpoConfig, GrpoRecipeConfig
from toolkit.grpo.prompts import PromptSet
from toolkit.train import head

TEMPERATURE = 0.7


class _SamplersOwn(LogitsProcessor):
    """Records, before the seeded sampler adds its noise, the log-probs of the distribution it draws from."""

    def __init__(self, sampler: sampling.SeededSampling):
        self.sampler, self.steps = sampler, []

    def __call__(self, input_ids, scores):
        self.steps.append(self.sampler.processed(input_ids, scores).log_softmax(-1))
        return scores


def _sampled_round(model, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """Completions of three prompts sampled by `sampling`'s generate path, with the sampler's own log-prob
    of each sampled token, as a Rollout the trainer scores."""
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3, 4]]
    seeds = [sampling.completion_seed(42, 0, slot, slot, 0) for slot in range(3)]
    width, new = max(map(len, prompts)), 6
    sampler = sampling.SeededSampling(seeds, temperature, top_k, top_p, width)
    own = _SamplersOwn(sampler)
    completions = sampling._generated(model, prompts, new, 0, 1, False, None, [own, sampler])
    lengths = torch.tensor([len(c) for c in completions])
    padded = torch.zeros(3, new, dtype=torch.long)
    sampler_logps = torch.zeros(3, new, dtype=torch.float64)
    for row, tokens in enumerate(completions):
        padded[row, : len(tokens)] = torch.tensor(tokens)
        for j, token in enumerate(tokens):
            sampler_logps[row, j] = float(own.steps[j][row, token])
    rollout = rollouts.Rollout(
        0, torch.arange(3), padded, lengths, {"total": torch.zeros(3, dtype=torch.float64)},
        torch.ones(3, dtype=torch.float64), None, None, torch.arange(3),
    )  # fmt: skip
    return rollout, PromptSet(prompts, ["", "", ""], ["", "", ""]), sampler_logps


def _trainer_logps(model, rollout, prompts, temperature: float, top_k=0, top_p=1.0) -> torch.Tensor:
    recipe = GrpoRecipeConfig()
    recipe.train.global_batch_size = recipe.train.micro_batch_size = 3
    recipe.grpo.max_new_tokens = rollout.completions.size(1)
    (batch,) = rollout.micro_batches(torch.arange(3), prompts, recipe, 0, 0, 1, "cpu")
    with torch.no_grad():
        return grpo_loss.completion_logps(model, batch, temperature, top_k, top_p).double()


@pytest.mark.parametrize("cut", [(0, 1.0), (5, 1.0), (0, 0.6), (5, 0.6)], ids=["whole", "k", "p", "k+p"])
@pytest.mark.parametrize("chunked", [False, True], ids=["full head", "chunked head"])
def test_the_trainer_scores_each_sampled_token_as_the_sampler_drew_it(chunked, cut):
    torch.manual_seed(0)
    model = micro_llama(vocab_size=64).eval()
    rollout, prompts, sampler_logps = _sampled_round(model, TEMPERATURE, *cut)
    assert int(rollout.lengths.sum()) >= 10
    if chunked:
        head.install(model, chunk_tokens=5)
    got = _trainer_logps(model, rollout, prompts, TEMPERATURE, *cut)
    mask = torch.arange(got.size(1)) < rollout.lengths[:, None]
    assert (got - sampler_logps).abs()[mask].max() < 1e-5
    # The untempered log-probs are another distribution's, far off at 0.7: what the check above catches.
    untempered = _trainer_logps(model, rollout, prompts, 1.0, *cut)
    assert (untempered - sampler_logps).abs()[mask].max() > 1e-2
    if cut != (0, 1.0):  # and so are the whole softmax's (the kept tokens' mass, log'd, a token)
        whole = _trainer_logps(model, rollout, prompts, TEMPERATURE)
        assert (whole - sampler_logps).abs()[mask].max() > 1e-2


def _labelled(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (4, 12), generator=gen)
    labels = ids.clone()
    labels[:, :3] = IGNORE
    labels[1, 8:] = IGNORE
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def _tempered_reference(model, batch, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1] / temperature
    targets = batch["labels"][:, 1:]
    if top_k or top_p < 1.0:  # the cut written out here: HF's warpers, each target kept
        cut = [TopKLogitsWarper(top_k)] if top_k else []
        cut += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
        flat = logits.reshape(-1, logits.size(-1))
        for warper in cut:
            flat = warper(None, flat)
        gone = flat.reshape(logits.shape).isinf()
        gone.scatter_(-1, targets.clamp(min=0)[..., None], False)
        logits = logits.masked_fill(gone, float("-inf"))
    picked = logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    return picked.masked_fill(targets == IGNORE, 0.0)


@pytest.mark.parametrize(
    "build",
    [
        lambda: micro_llama(vocab_size=64),
        lambda: Gemma2ForCausalLM(
            Gemma2Config(
                vocab_size=64,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=8,
                final_logit_softcapping=0.5,
                attn_implementation="eager",
            )
        ),  # fmt: skip
    ],
    ids=["llama", "soft-capped gemma2"],
)
@pytest.mark.parametrize("uniform", [True, False], ids=["gradient in forward", "recomputed"])
@pytest.mark.parametrize("cut", [(0, 1.0), (6, 0.7)], ids=["whole", "k+p"])
def test_the_chunked_head_tempers_log_probs_and_their_gradients(build, uniform, cut):
    torch.manual_seed(0)
    full = build().double()
    chunked = copy.deepcopy(full)
    head.install(chunked, chunk_tokens=5)
    batch = _labelled()
    weights = torch.linspace(-1.0, 2.0, 11, dtype=torch.float64) if not uniform else -1.0
    expected = _tempered_reference(full, batch, TEMPERATURE, *cut)
    got = head.target_logps(chunked, batch, uniform, TEMPERATURE, *cut)
    assert not got.isinf().any()  # every target kept, also one the cut would drop
    if cut != (0, 1.0):
        assert (got - _tempered_reference(full, batch, TEMPERATURE)).abs().max() > 1e-2
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    (expected * weights).sum().backward()
    (got * weights).sum().backward()
    for (name, a), (_, b) in zip(full.named_parameters(), chunked.named_parameters(), strict=True):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)
    # The head is left untempered for the next caller (SFT's loss, generation's own logits).
    assert chunked.lm_head.shape.temperature == 1.0
    assert torch.allclose(head.target_logps(chunked, batch), _tempered_reference(full, batch, 1.0))


def test_the_reference_and_the_teacher_score_at_the_sampling_temperature(monkeypatch):
    """The round's policy, reference and teacher tables go through `scored` with grpo.temperature and the
    whole softmax; only the table the engine's log-probs are compared with (`cut`) takes top-k / top-p."""
    seen = []
    monkeypatch.setattr(rollouts, "completion_logps", lambda m, b, *s: seen.append(s) or torch.zeros(1, 1))

    class Scorer:
        def logps(self, batch, *sampling):
            seen.append(sampling)
            return torch.zeros(1, 1)

    cfg = GrpoRecipeConfig()
    cfg.grpo = GrpoConfig(temperature=TEMPERATURE, max_new_tokens=1, top_k=3, top_p=0.9)
    batches = [{"x": 0}]

    class Round:
        prompt = torch.zeros(1)

        def micro_batches(self, *args):
            return batches

    from helpers import OneProcess

    run = type("R", (), {"accelerator": OneProcess()})()
    rollouts.scored(run, None, Round(), None, cfg, 0, None)
    rollouts.scored(run, None, Round(), None, cfg, 0, Scorer())
    rollouts.scored(run, None, Round(), None, cfg, 0, None, cut=True)
    assert seen == [(TEMPERATURE,), (TEMPERATURE,), (TEMPERATURE, 3, 0.9)]
