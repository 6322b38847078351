"""On-policy distillation over multi-turn conversations (grpo.teacher with grpo.environment): the teacher
reads the whole conversation, the environment's turns included, and scores the model's tokens alone; its
term is log T - log pi_old on those and exactly 0 on the environment's; teacher_kl averages over the model's
tokens; a teacher that is the policy gives nothing; and the recipe runs it and resumes a round exactly.

The conversations are the scripted agent's (tests/scripted_agent.py): it opens tool calls the environment
answers with error turns, so most conversations hold environment tokens between turns of the model's."""

from __future__ import annotations

import copy
import shutil

import pytest
import scripted_agent
import torch
from helpers import REPO, load_recipe, short_grpo_args, train_lines
from test_grpo_teacher import Run, _recipe, _token_gradient
from test_grpo_turns import BUDGET, CALCULATOR, agent_prompt, hf_conversations
from transformers import AutoModelForCausalLM, AutoTokenizer

from toolkit.data.chat import ensure_chat_template
from toolkit.errors import run_main
from toolkit.grpo import prompts as prompt_sets
from toolkit.grpo import rollout as rollouts
from toolkit.grpo import teacher as teachers
from toolkit.grpo.config import GrpoConfig, load_grpo_config

SEEDS = list(range(200, 212))
TOOLS_DATA = REPO / "toolkit" / "assets" / "demo" / "tools_eval.jsonl"


def perturbed(model, scale: float = 0.05, seed: int = 0):
    """`model` with every weight moved at random: its attention no longer writes nothing, so a token's score
    depends on the whole context, not on the token before it alone."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return other


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """(the scripted agent in float64, its tokenizer, its folder)."""
    folder = scripted_agent.build(tmp_path_factory.mktemp("agent"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ensure_chat_template(tokenizer)
    return AutoModelForCausalLM.from_pretrained(folder).double().eval(), tokenizer, folder


@pytest.fixture(scope="module")
def talks(agent):
    model, tokenizer, _ = agent
    with pytest.MonkeyPatch.context() as patch:
        return hf_conversations(patch, model, tokenizer, SEEDS)


@pytest.fixture
def round_of_talks(agent, talks):
    """A round of the agent's conversations as the recipe holds it (completions, lengths, mask, counts)."""
    _, tokenizer, _ = agent
    rows = len(talks)
    completions = torch.zeros(rows, BUDGET, dtype=torch.long)
    for i, talk in enumerate(talks):
        completions[i, : len(talk.tokens)] = torch.tensor(talk.tokens)
    rollout = rollouts.Rollout(
        0, torch.zeros(rows, dtype=torch.long), completions, torch.tensor([len(t.tokens) for t in talks]),
        {"total": torch.zeros(rows, dtype=torch.float64)}, torch.zeros(rows, dtype=torch.float64), None,
        None, torch.arange(rows),
    )  # fmt: skip
    rollout.mask, rollout.turn_stats = rollouts.conversation_tables(Run.accelerator, talks, BUDGET)
    inside = torch.arange(BUDGET) < rollout.lengths[:, None]
    assert ((rollout.mask == 0) & inside).any() and (rollout.turn_stats["turns"] > 1).any()
    return rollout, prompt_sets.PromptSet([agent_prompt(tokenizer)], [""], [""])


def scores_in_context(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Each of `tokens`' log-prob after the prompt and every token before it: one plain forward pass."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logps = model(ids).logits[0].double().log_softmax(-1)
    return logps[torch.arange(len(tokens)) + len(prompt) - 1, torch.tensor(tokens)]


def expected_gap(model, teacher, rollout, prompts) -> torch.Tensor:
    """log T - log pi of every model token over the whole conversation, 0 elsewhere, computed apart."""
    gap = torch.zeros(rollout.completions.shape, dtype=torch.float64)
    for i in range(len(rollout.prompt)):
        tokens = rollout.completions[i, : rollout.lengths[i]].tolist()
        prompt = prompts.ids[int(rollout.prompt[i])]
        both = scores_in_context(teacher, prompt, tokens) - scores_in_context(model, prompt, tokens)
        gap[i, : len(tokens)] = both * rollout.mask[i, : len(tokens)]
    return gap


@pytest.mark.parametrize("old", [False, True], ids=["scored-after-sampling", "round-old-logps"])
def test_the_teacher_scores_the_models_tokens_in_the_whole_conversation(agent, round_of_talks, old):
    """The gap is log T - log pi_old on the model's tokens (the policy's from the round's old log-probs when
    it keeps them), computed with every environment turn in the context, and exactly 0 on the environment's
    tokens; the loss pushes each model token by -(A + w x gap) and leaves the environment's alone."""
    model, _, _ = agent
    rollout, prompts = round_of_talks
    teacher = perturbed(model)
    recipe = _recipe(len(rollout.prompt), 4, BUDGET)
    if old:
        rollout.old_logps = rollouts.scored(Run(), model, rollout, prompts, recipe, 0, None)
    teachers.score(Run(), model, rollout, prompts, recipe, 0, teachers.Teacher(teacher))
    expected = expected_gap(model, teacher, rollout, prompts)
    model_tokens = rollout.mask == 1
    assert torch.allclose(rollout.teacher_gap, expected, rtol=1e-9, atol=1e-9)
    assert torch.all(rollout.teacher_gap[~model_tokens] == 0)
    assert (rollout.teacher_gap[model_tokens].abs() > 0.1).sum() >= 10  # the teacher differs: a signal
    rollout.advantages = torch.linspace(-1, 1, len(rollout.prompt), dtype=torch.float64)
    got = _token_gradient(model, rollout, prompts, GrpoConfig(loss="dapo", teacher_weight=0.5))
    columns = got.size(1)
    want = -(rollout.advantages[:, None] + 0.5 * expected[:, :columns]) * model_tokens[:, :columns]
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-9)


def test_the_environments_turns_are_context_for_the_teacher(agent, round_of_talks):
    """Dropping a conversation's environment turns changes the teacher's scores of the model's later
    tokens: the teacher read them (the gap of test_the_teacher_scores_... matches the full context)."""
    model, _, _ = agent
    rollout, prompts = round_of_talks
    teacher = perturbed(model)
    row = int(torch.nonzero(rollout.turn_stats["turns"] > 1)[0])
    tokens = rollout.completions[row, : rollout.lengths[row]].tolist()
    kept = rollout.mask[row, : len(tokens)].bool()
    prompt = prompts.ids[0]
    full = scores_in_context(teacher, prompt, tokens)[kept]
    without = scores_in_context(teacher, prompt, [t for t, k in zip(tokens, kept.tolist()) if k])
    first_turn = int(torch.nonzero(~kept)[0])  # the model's tokens before the first environment turn agree
    assert torch.allclose(full[:first_turn], without[:first_turn], atol=1e-12)
    assert (full[first_turn:] - without[first_turn:]).abs().max() > 1e-3


def test_teacher_kl_averages_over_the_models_tokens_alone(agent, round_of_talks):
    model, _, _ = agent
    rollout, prompts = round_of_talks
    teacher = perturbed(model)
    recipe = _recipe(len(rollout.prompt), 4, BUDGET)
    recipe.grpo.num_generations = 4
    teachers.score(Run(), model, rollout, prompts, recipe, 0, teachers.Teacher(teacher))
    expected = expected_gap(model, teacher, rollout, prompts)
    rows = torch.arange(len(rollout.prompt))
    trained, _ = rollouts.step_counts(rollout, rows, prompts)
    assert trained == int(rollout.mask.sum()) < int(rollout.lengths.sum())
    logged = rollouts.StepStats(recipe).metrics(rollout, rows, torch.zeros(5, dtype=torch.float64), trained)
    model_tokens = rollout.mask == 1
    assert logged["teacher_kl"] == pytest.approx(-float(expected[model_tokens].mean()), rel=1e-9)
    restored = rollouts.Rollout.from_state_dict(rollout.state_dict())  # what a checkpoint keeps of the round
    assert torch.equal(restored.teacher_gap, rollout.teacher_gap) and torch.equal(restored.mask, rollout.mask)


def test_a_teacher_that_is_the_policy_gives_nothing_over_conversations(agent, round_of_talks):
    model, _, _ = agent
    rollout, prompts = round_of_talks
    recipe = _recipe(len(rollout.prompt), 4, BUDGET)
    teachers.score(Run(), model, rollout, prompts, recipe, 0, teachers.Teacher(copy.deepcopy(model)))
    assert rollout.teacher_gap.shape == (len(SEEDS), BUDGET) and torch.all(rollout.teacher_gap == 0)


def test_a_teacher_with_an_environment_is_accepted():
    cfg = load_grpo_config(
        None,
        [
            "model.adapter=null",
            "grpo.teacher=toolkit/assets/tiny-llama",
            f"grpo.environment.tools=[{CALCULATOR}]",
        ],
    )
    assert cfg.grpo.teacher and cfg.grpo.environment.tools


def run_distill(out, agent_folder, teacher_folder) -> int:
    argv = [
        *short_grpo_args(out, 2, 8, 4),
        f"model.path={agent_folder}",
        "model.method=lora",
        "train.learning_rate=2e-3",
        "train.save_every_steps=1",
        f"data.train={TOOLS_DATA}",
        "data.max_length=224",
        "grpo.num_generations=4",
        "grpo.max_new_tokens=64",
        "grpo.max_turns=3",
        "grpo.steps_per_generation=2",
        "grpo.rewards=[]",
        f"grpo.teacher={teacher_folder}",
        f"grpo.environment.tools=[{CALCULATOR}]",
    ]
    return run_main(load_recipe("grpo_llm").main, argv, "grpo_llm")


@pytest.mark.usefixtures("signal_handlers_restored")
def test_the_recipe_distills_over_conversations_and_resumes_a_round_exactly(agent, tmp_path, capsys):
    """Two steps on one round of conversations (the teacher's signal alone), checkpointed after each; a
    relaunch from step 1's checkpoint trains step 2 on the saved round (its teacher gaps among it) and logs
    what the uninterrupted run did."""
    model, tokenizer, folder = agent
    teacher = tmp_path / "teacher"
    perturbed(model).float().save_pretrained(teacher)
    tokenizer.save_pretrained(teacher)
    out = tmp_path / "run"
    assert run_distill(out, folder, teacher) == 0
    lines = train_lines(out)
    assert [r["step"] for r in lines] == [1, 2]
    assert all(r["teacher_kl"] != 0 and r["grad_norm"] > 0 and r["reward"] == 0 for r in lines)
    assert sum(r["tool_calls"] for r in lines) > 0
    again = tmp_path / "again"
    shutil.copytree(out, again)
    shutil.rmtree(again / "checkpoints" / "step-2")
    shutil.rmtree(again / "final")
    capsys.readouterr()
    assert run_distill(again, folder, teacher) == 0
    assert "resum" in capsys.readouterr().out
    assert [r["step"] for r in train_lines(again)] == [1, 2]
    for key in ("loss", "grad_norm", "teacher_kl", "turns", "tool_calls"):
        assert train_lines(again)[-1][key] == lines[-1][key], key
