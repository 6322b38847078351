"""On-policy distillation (grpo.teacher): the per-token estimator's sign and masking, no signal from a
teacher that is the policy, the reverse (not forward) KL it estimates, multi-turn conversations (the teacher
reads the environment's tokens as context and scores the model's alone), and the refusals."""

import copy
import json
import shutil

import pytest
import torch
from helpers import REPO, OneProcess, load_recipe, micro_llama
from transformers import AutoTokenizer

from toolkit.errors import UserError
from toolkit.grpo import loss as grpo_loss
from toolkit.grpo import prompts as prompt_sets
from toolkit.grpo import rollout as rollouts
from toolkit.grpo import teacher as teachers
from toolkit.grpo.config import GrpoConfig, GrpoRecipeConfig, load_grpo_config

TINY = REPO / "toolkit" / "assets" / "tiny-llama"


class Run:
    accelerator = OneProcess()


def _round(rows: int, width: int = 6, seed: int = 0, length_one: bool = False):
    """A round of `rows` completions of random tokens and lengths after one of three prompts."""
    gen = torch.Generator().manual_seed(seed)
    lengths = (
        torch.ones(rows, dtype=torch.long)
        if length_one
        else torch.randint(1, width + 1, (rows,), generator=gen)
    )
    completions = torch.randint(2, 64, (rows, width), generator=gen) * (
        torch.arange(width) < lengths[:, None]
    )
    prompts = prompt_sets.PromptSet([[3, 4, 5], [7, 8], [9, 10, 11, 12]], ["", "", ""], ["", "", ""])
    rollout = rollouts.Rollout(
        0,
        torch.arange(rows) % 3,
        completions,
        lengths,
        {"total": torch.zeros(rows, dtype=torch.float64)},
        torch.zeros(rows, dtype=torch.float64),
        None,
        None,
        torch.arange(rows),
    )
    return rollout, prompts


def _recipe(rows: int, micro: int, width: int = 6) -> GrpoRecipeConfig:
    recipe = GrpoRecipeConfig(grpo=GrpoConfig(max_new_tokens=width))
    recipe.train.global_batch_size, recipe.train.micro_batch_size = rows, micro
    return recipe


def _token_gradient(model, rollout, prompts, cfg) -> torch.Tensor:
    """d(loss)/d(policy log-prob) of every completion token, the round trained in one micro-batch."""
    recipe = _recipe(len(rollout.prompt), len(rollout.prompt))
    (batch,) = rollout.micro_batches(torch.arange(len(rollout.prompt)), prompts, recipe, 0, 0, 1, "cpu")
    logps = grpo_loss.completion_logps(model, batch, 1.0).detach().requires_grad_()
    grpo_loss.micro_terms(cfg, logps, batch)["objective"].backward()
    return logps.grad


def test_each_token_is_pushed_by_its_own_gap_times_the_weight_inside_its_mask():
    """With the ratio at 1, the loss's gradient on a token's log-prob is minus (its completion's reward
    advantage + teacher_weight x its gap): a token the teacher likes better rises; past a completion's end
    and on the environment's tokens nothing moves."""
    model = micro_llama().double()
    rollout, prompts = _round(4)
    gen = torch.Generator().manual_seed(1)
    rollout.teacher_gap = torch.randn(4, 6, generator=gen, dtype=torch.float64)  # non-zero past the ends too
    rollout.mask = (torch.rand(4, 6, generator=gen) > 0.3).long()
    rollout.advantages = torch.tensor([0.5, -1.0, 0.0, 2.0], dtype=torch.float64)
    columns = int(rollout.lengths.max())
    inside = (torch.arange(columns) < rollout.lengths[:, None]).double() * rollout.mask[:, :columns]
    assert 0 < inside.sum() < inside.numel()
    for weight in (1.0, 0.25):
        cfg = GrpoConfig(loss="dapo", max_new_tokens=6, teacher_weight=weight)
        got = _token_gradient(model, rollout, prompts, cfg)
        expected = -(rollout.advantages[:, None] + weight * rollout.teacher_gap[:, :columns]) * inside
        assert torch.allclose(got, expected, rtol=1e-12, atol=1e-15), weight
    rollout.advantages.zero_()
    got = _token_gradient(model, rollout, prompts, GrpoConfig(loss="dapo", max_new_tokens=6))
    liked = (rollout.teacher_gap[:, :columns] > 0) & (inside > 0)
    assert liked.any() and torch.all(got[liked] < 0)  # descent raises the log-prob the teacher prefers
    assert torch.all(got[inside == 0] == 0)


def test_a_teacher_that_is_the_policy_gives_no_signal():
    model = micro_llama().double()
    rollout, prompts = _round(8, seed=2)
    teachers.score(Run(), model, rollout, prompts, _recipe(8, 2), 0, teachers.Teacher(copy.deepcopy(model)))
    assert rollout.teacher_gap.shape == (8, 6) and torch.all(rollout.teacher_gap == 0)
    got = _token_gradient(model, rollout, prompts, GrpoConfig(loss="dapo", max_new_tokens=6))
    assert torch.all(got == 0)
    teachers.score(Run(), model, rollout, prompts, _recipe(8, 2), 0, None)  # no teacher: left as it was
    assert torch.all(rollout.teacher_gap == 0)


def test_the_logged_signal_estimates_the_reverse_kl_on_the_policys_samples():
    """One-token completions drawn from the policy: minus the mean gap (teacher_kl) is KL(policy ||
    teacher) of the next-token distributions, not the forward KL, within the sampling error."""
    policy = micro_llama().double().eval()
    teacher = micro_llama().double().eval()
    torch.manual_seed(3)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.3 * torch.randn_like(p))
    rows = 3000
    rollout, prompts = _round(rows, length_one=True)
    rollout.prompt.zero_()
    context = torch.tensor([prompts.ids[0]])
    with torch.no_grad():
        p = policy(context).logits[0, -1].log_softmax(-1)
        q = teacher(context).logits[0, -1].log_softmax(-1)
    draws = torch.multinomial(p.exp(), rows, replacement=True, generator=torch.Generator().manual_seed(4))
    rollout.completions[:, 0] = draws
    teachers.score(Run(), policy, rollout, prompts, _recipe(rows, 500), 0, teachers.Teacher(teacher))
    reverse = float((p.exp() * (p - q)).sum())
    forward = float((q.exp() * (q - p)).sum())
    estimate = -float(rollout.teacher_gap.sum()) / rows
    spread = float((p - q)[draws].std()) / rows**0.5
    assert abs(estimate - reverse) < 4 * spread < abs(forward - reverse), (estimate, reverse, forward)
    stats = rollouts.StepStats(_recipe(rows, 500))
    rollout.generation_seconds = 0.0
    logged = stats.metrics(
        rollout, torch.arange(rows), torch.zeros(grpo_loss.SUMMED_TERMS, dtype=torch.float64), rows
    )
    assert logged["teacher_kl"] == pytest.approx(estimate, rel=1e-12)


def test_the_gap_survives_the_checkpoint_form():
    rollout, _ = _round(4)
    rollout.teacher_gap = torch.randn(4, 6, dtype=torch.float64)
    assert torch.equal(
        rollouts.Rollout.from_state_dict(rollout.state_dict()).teacher_gap, rollout.teacher_gap
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["grpo.rewards=[]"], "grpo.rewards: name at least one reward function, or a grpo.teacher"),
        (["grpo.teacher=toolkit/assets/tiny-llama", "grpo.teacher_weight=0"], "grpo.teacher_weight"),
        (
            ["grpo.teacher=toolkit/assets/tiny-llama", "grpo.generation=vllm", "grpo.teacher_weight=0"],
            "grpo.teacher_weight",
        ),
    ],
)
def test_bad_teacher_settings_name_the_key(overrides, message):
    with pytest.raises(UserError, match=message):
        load_grpo_config(None, ["model.adapter=null", *overrides])


def test_a_teacher_alone_is_enough():
    cfg = load_grpo_config(None, ["model.adapter=null", "grpo.rewards=[]", f"grpo.teacher={TINY}"])
    teachers.check_tokenizers(cfg)  # the same model's tokenizer: accepted
    assert teachers.teacher_parts(str(TINY)) == (str(TINY), None)


def _teacher_folder(tmp_path, change) -> str:
    """tiny-llama's config and tokenizer in a folder of their own, the tokenizer changed by `change`."""
    folder = tmp_path / "teacher"
    folder.mkdir()
    shutil.copyfile(TINY / "config.json", folder / "config.json")
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    change(tokenizer)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.add_tokens(["<extra>"]), "vocabularies of"),
        (lambda t: setattr(t, "eos_token", t.convert_ids_to_tokens(5)), "eos_token_id"),
    ],
    ids=["vocabulary", "special"],
)
def test_a_teacher_with_another_tokenizer_is_refused_before_the_run_writes(tmp_path, change, message):
    teacher = _teacher_folder(tmp_path, change)
    out = tmp_path / "run"
    args = ["model.adapter=null", "grpo.rewards=[]", f"grpo.teacher={teacher}", f"output_dir={out}"]
    with pytest.raises(UserError, match=f"grpo.teacher: {teacher}: its tokenizer differs .*{message}"):
        load_recipe("grpo_llm").main(args)
    assert not out.exists()


def test_teacher_folders_are_a_model_or_one_adapter_on_its_base(tmp_path):
    with pytest.raises(UserError, match="grpo.teacher: .*nowhere does not exist"):
        teachers.check_tokenizers(load_grpo_config(None, ["model.adapter=null", "grpo.teacher=./nowhere"]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds neither a model"):
        teachers.teacher_parts(str(tmp_path / "empty"))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(TINY)}))
    assert teachers.teacher_parts(str(adapter)) == (str(TINY), str(adapter))
    (adapter / "start_adapter").mkdir()
    with pytest.raises(UserError, match="an adapter trained over another one"):
        teachers.teacher_parts(str(adapter))
