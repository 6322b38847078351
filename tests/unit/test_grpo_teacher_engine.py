"""On-policy distillation on rounds the vLLM engine samples, against a fake engine in this process: the
teacher's gap is log T - log pi_old of the engine's tokens (never the engine's own log-probs), 0 past each
completion; the loss weights it by the same truncated importance weight as the reward's advantage; a round
sampled ahead is scored against the weights it trains from, and a checkpoint taken while it is in flight
gives the resumed run the same gaps."""

import copy
import itertools
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import REPO, OneProcess, micro_llama

from toolkit.engine import client
from toolkit.grpo import engine as engine_module
from toolkit.grpo import loss as grpo_loss
from toolkit.grpo import prompts as prompt_sets
from toolkit.grpo import rollout as rollouts
from toolkit.grpo import teacher as teachers
from toolkit.grpo.config import load_grpo_config
from toolkit.grpo.engine import EngineSampler
from toolkit.grpo.rewards import Rewards

TINY = REPO / "toolkit" / "assets" / "tiny-llama"
WIDTH = 6
DISTILL = [
    "model.adapter=null",
    "grpo.generation=vllm",
    f"grpo.teacher={TINY}",
    "grpo.rewards=[]",
    "grpo.loss=dapo",
    f"grpo.max_new_tokens={WIDTH}",
    "grpo.num_generations=4",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
]


# The rollout appends its sample rollouts (grpo/samples.py) to the run folder: a folder of the test's own.
RUN = SimpleNamespace(
    accelerator=OneProcess(), output_dir=Path(tempfile.mkdtemp(prefix="grpo-teacher-engine-"))
)
TOKENIZER = SimpleNamespace(
    pad_token_id=0,
    eos_token_id=1,
    batch_decode=lambda ids, skip_special_tokens: ["" for _ in ids],
    decode=lambda ids, skip_special_tokens=False: "",
)
PROMPTS = prompt_sets.PromptSet(
    [[3, 4, 5], [7, 8], [9, 10, 11, 12], [13], [14, 15], [16, 17, 18]], *[[""] * 6] * 2
)


class FakeEngine:
    """Random completions, another draw on every call (a round asked twice would differ), with made-up
    log-probs far from the trainer's (-1 - token / 10), so truncation bites on some tokens."""

    url, process = "http://fake", None

    def __init__(self):
        self.calls = itertools.count()

    def complete(self, url, name, prompts, seeds, sampling, stop_ids, max_tokens=None, stop=None, n=1):
        call = next(self.calls)
        done = []
        for seed in [s + i for s in seeds for i in range(n)]:  # the i-th of n seeded seed + i, as vLLM's
            gen = torch.Generator().manual_seed((seed * 7 + call) % 2**62)
            length = int(torch.randint(1, WIDTH + 1, (1,), generator=gen))
            tokens = torch.randint(2, 64, (length,), generator=gen).tolist()
            done.append(client.Completion(tokens, [-1.0 - 0.1 * t for t in tokens]))
        return done

    def check_alive(self):
        pass

    def stop(self):
        pass


@pytest.fixture
def engine(monkeypatch):
    fake = FakeEngine()
    monkeypatch.setattr(client, "complete", fake.complete)
    monkeypatch.setattr(engine_module, "adapter_state", lambda accelerator, model: ({}, 0))
    monkeypatch.setattr(engine_module, "saver", lambda accelerator, model: None)
    samplers = []

    def sampler(cfg):
        built = EngineSampler(RUN.accelerator, cfg, fake)
        built.ready, built._load = True, lambda policy, state, round_index: None
        samplers.append(built)
        return built

    yield sampler
    for built in samplers:
        built.close()


def models():
    """(policy, teacher): the micro model and a perturbed copy, in float64."""
    policy = micro_llama().double()
    teacher = copy.deepcopy(policy)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return policy, teacher


def direct_logps(model, rollout) -> torch.Tensor:
    """Each sampled token's log-prob under `model`, one row at a time, [N, WIDTH] (0 past each end)."""
    table = torch.zeros(len(rollout.prompt), WIDTH, dtype=torch.float64)
    with torch.no_grad():
        for i, (p, n) in enumerate(zip(rollout.prompt.tolist(), rollout.lengths.tolist(), strict=True)):
            prompt, tokens = PROMPTS.ids[p], rollout.completions[i, :n]
            ids = torch.tensor([prompt + tokens.tolist()])
            logits = model(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
            table[i, :n] = logits.gather(-1, tokens[:, None]).squeeze(-1)
    return table


def engine_round(sampler, policy, teacher, cfg, round_index: int):
    rollout = rollouts.generate(
        RUN, policy, PROMPTS, Rewards({}, []), cfg, TOKENIZER, round_index, None, sampler
    )
    teachers.score(RUN, policy, rollout, PROMPTS, cfg, 0, teachers.Teacher(teacher))
    return rollout


@pytest.mark.parametrize("steps", [1, 2], ids=["fresh-pass", "old-logps"])
def test_the_gap_of_the_engines_tokens_is_the_teachers_minus_the_trainers(engine, steps):
    cfg = load_grpo_config(None, [*DISTILL, f"grpo.steps_per_generation={steps}"])
    policy, teacher = models()
    rollout = engine_round(engine(cfg), policy, teacher, cfg, 0)
    assert rollout.engine_logps is not None and (rollout.old_logps is not None) == (steps > 1)
    inside = torch.arange(WIDTH) < rollout.lengths[:, None]
    assert 0 < inside.sum() < inside.numel()
    expected = direct_logps(teacher, rollout) - direct_logps(policy, rollout)
    assert torch.allclose(rollout.teacher_gap, expected, rtol=0, atol=1e-10)
    assert torch.all(rollout.teacher_gap[~inside] == 0) and torch.all(rollout.teacher_gap[inside] != 0)
    # Not the engine's log-probs: they are far from the trainer's here.
    against_engine = (direct_logps(teacher, rollout) - rollout.engine_logps)[inside]
    assert (against_engine - rollout.teacher_gap[inside]).abs().min() > 1e-3


def test_the_teacher_term_goes_through_the_truncated_importance_weight(engine):
    """d(loss)/d(log pi) of every token is -(A + w x gap) x min(pi_old / engine, cap) inside, 0 outside."""
    cfg = load_grpo_config(None, [*DISTILL, "grpo.steps_per_generation=2", "grpo.teacher_weight=0.5"])
    policy, teacher = models()
    rollout = engine_round(engine(cfg), policy, teacher, cfg, 0)
    rollout.advantages = torch.linspace(-1, 1, len(rollout.prompt), dtype=torch.float64)
    whole = copy.deepcopy(cfg)
    whole.train.micro_batch_size = len(rollout.prompt)
    rows = torch.arange(len(rollout.prompt))
    (batch,) = rollout.micro_batches(rows, PROMPTS, whole, 0, 0, 1, "cpu")
    logps = grpo_loss.completion_logps(policy, batch, 1.0).detach().requires_grad_()
    grpo_loss.micro_terms(cfg.grpo, logps, batch)["objective"].backward()
    columns = logps.size(1)
    inside = (torch.arange(columns) < rollout.lengths[:, None]).double()
    weight = torch.exp(rollout.old_logps - rollout.engine_logps)[:, :columns]
    assert (weight * inside > cfg.grpo.engine_is_cap).any() and (
        (weight < cfg.grpo.engine_is_cap) & (inside > 0)
    ).any()
    advantage = rollout.advantages[:, None] + 0.5 * rollout.teacher_gap[:, :columns]
    expected = -advantage * weight.clamp(max=cfg.grpo.engine_is_cap) * inside
    assert torch.allclose(logps.grad, expected, rtol=1e-9, atol=1e-12)


def test_a_round_sampled_ahead_is_scored_against_the_weights_it_trains_from_and_resumes_exactly(engine):
    """grpo.async_rounds=1, rounds of one step: round 1 is sampled with round 0's weights while round 0
    trains; its gap is taken against the weights after that step. A checkpoint after step 1 keeps round 1
    as tokens; the resumed run scores them to the very same gaps, without asking the engine again."""
    cfg = load_grpo_config(None, [*DISTILL, "grpo.async_rounds=1", "train.max_steps=3"])
    policy, teacher = models()
    sampler = engine(cfg)
    engine_round(sampler, policy, teacher, cfg, 0)
    before = copy.deepcopy(policy)
    torch.manual_seed(6)
    with torch.no_grad():  # round 0's optimizer step
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    state = rollouts.recipe_state(None, sampler)  # waits for round 1, in flight
    assert int(state["ahead.about"][0]) == 1
    ahead = engine_round(sampler, policy, teacher, cfg, 1)
    assert ahead.staleness == 1
    trained_from = direct_logps(teacher, ahead) - direct_logps(policy, ahead)
    assert torch.allclose(ahead.teacher_gap, trained_from, rtol=0, atol=1e-10)
    sampled_with = direct_logps(teacher, ahead) - direct_logps(before, ahead)
    assert (ahead.teacher_gap - sampled_with).abs().max() > 1e-3

    resumed = engine(cfg)
    assert rollouts.resumed(state, 1, cfg, resumed) is None  # step 1 finished round 0
    again = engine_round(resumed, policy, teacher, cfg, 1)
    assert torch.equal(again.completions, ahead.completions)  # the kept tokens, not a new draw
    assert torch.equal(again.teacher_gap, ahead.teacher_gap)
    assert torch.equal(again.engine_logps, ahead.engine_logps)


def test_a_teacher_with_the_engine_and_async_rounds_is_a_valid_config():
    cfg = load_grpo_config(None, [*DISTILL, "grpo.async_rounds=1"])
    assert (cfg.grpo.generation, cfg.grpo.teacher, cfg.grpo.async_rounds) == ("vllm", str(TINY), 1)
