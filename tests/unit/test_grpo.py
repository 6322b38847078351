"""The GRPO recipe's parts: config checks, prompts, seeded sampling, rewards, advantages, and a loss whose
gradient does not depend on how a step's completions are split into micro-batches."""

from pathlib import Path

import pytest
import torch
from helpers import OneProcess, micro_llama

from toolkit.data.encode import IGNORE
from toolkit.errors import UserError
from toolkit.grpo import loss as grpo_loss
from toolkit.grpo import prompts as prompt_sets
from toolkit.grpo import rollout as rollouts
from toolkit.grpo import sampling
from toolkit.grpo.config import GrpoConfig, GrpoRecipeConfig, load_grpo_config
from toolkit.grpo.rewards import Rewards
from toolkit.train.batches import grad_accum_steps
from toolkit.train.loss import backward_scale
from toolkit.typed_yaml import field_docs

REPO = Path(__file__).resolve().parents[2]
SHIPPED_GRPO = sorted((REPO / "recipes" / "configs").rglob("*grpo*.yaml"))


@pytest.mark.parametrize("path", SHIPPED_GRPO, ids=lambda p: p.name)
def test_every_shipped_grpo_config_loads(path):
    cfg = load_grpo_config(path, [])
    assert cfg.grpo.num_generations >= 2 and grad_accum_steps(cfg.train, 2) >= 1


def test_the_demo_config_is_the_packaged_one():
    packaged = REPO / "toolkit" / "assets" / "demo-grpo.yaml"
    assert packaged.read_bytes() == (REPO / "recipes" / "configs" / "demo-grpo.yaml").read_bytes()
    assert load_grpo_config(None, []).output_dir == "runs/demo-grpo"


def test_every_grpo_key_is_documented():
    docs = field_docs(GrpoRecipeConfig)
    assert all(docs.get(f"grpo.{name}") for name in GrpoConfig.__dataclass_fields__)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["grpo.num_generations=3"], "must be a multiple of grpo.num_generations"),
        (["grpo.rewards=[exact]"], "grpo.rewards: unknown reward 'exact'"),
        (["grpo.rewards=[]"], "grpo.rewards: name at least one"),
        (["grpo.reward_weights=[1.0,2.0]"], "grpo.reward_weights: 2 weights for 1"),
        (["model.method=full", "grpo.beta=0.1"], "needs grpo.reference_model"),
        (["grpo.reference_model=./nowhere"], "grpo.reference_model: ./nowhere does not exist"),
        (["data.packing=true"], "data.packing and data.streaming are for SFT"),
        (["pipeline.size=2"], "pipeline.size: GRPO does not run on a pipeline"),
        (["grpo.num_generations=1"], "grpo.num_generations"),
        (["grpo.top_p=0"], "grpo.top_p"),
        (["grpo.loss=ppo"], "grpo.loss"),
        (["grpo.generation=vllm", "lora.use_dora=true"], "lora.use_dora adapters are not loaded"),
        (
            ["grpo.generation=vllm", "model.method=full", "grpo.vllm.host=0.0.0.0"],
            "grpo.vllm.host: 0.0.0.0 would expose vLLM's development endpoints",
        ),
        (["grpo.generation=vlm"], "grpo.generation"),
        (["grpo.vllm.gpu_memory_utilization=0"], "grpo.vllm.gpu_memory_utilization"),
    ],
)
def test_bad_grpo_settings_name_the_key(overrides, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_grpo_config(None, ["model.adapter=null", *overrides])


@pytest.mark.parametrize(
    "setting",
    [
        "grpo.vllm.gpus=2,3",
        "grpo.vllm.url=http://127.0.0.1:8000",
        "grpo.vllm.sleep=true",
        "grpo.vllm.sleep=false",
        "grpo.vllm.kv_cache_gb=4",
        "grpo.vllm.host=0.0.0.0",
    ],
)
def test_an_engine_setting_is_refused_while_hf_generates(setting):
    key = setting.partition("=")[0]
    with pytest.raises(UserError) as info:
        load_grpo_config(None, ["model.adapter=null", setting])
    assert str(info.value) == (
        f"{key}: only applies with grpo.generation: vllm (it is hf); drop it or set grpo.generation=vllm"
    )
    load_grpo_config(None, ["model.adapter=null", "grpo.generation=vllm", setting])  # the engine reads it


def test_engine_settings_spelled_at_their_defaults_pass_while_hf_generates():
    defaults = [
        "grpo.vllm.host=127.0.0.1",
        "grpo.vllm.port=0",
        "grpo.vllm.start_timeout_s=600",
        "grpo.vllm.url=null",
    ]
    assert load_grpo_config(None, defaults).grpo.generation == "hf"


def test_the_last_assistant_turn_is_the_answer():
    row = {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "labels": [IGNORE, IGNORE, 3, IGNORE, IGNORE, 6, 7, IGNORE]}
    assert prompt_sets.last_turn(row) == ([1, 2, 3, 4, 5], [6, 7])
    assert prompt_sets.last_turn({"input_ids": [1, 2], "labels": [IGNORE, IGNORE]}) is None
    assert prompt_sets.last_turn({"input_ids": [1, 2], "labels": [1, 2]}) is None  # nothing before it


def test_rounds_use_every_prompt_once_before_any_again():
    picked = [prompt_sets.round_prompts(10, 4, r, seed=3) for r in range(5)]
    first_pass = sum(picked[:2], []) + picked[2][:2]
    assert sorted(first_pass) == list(range(10))
    assert picked == [prompt_sets.round_prompts(10, 4, r, seed=3) for r in range(5)]
    assert picked != [prompt_sets.round_prompts(10, 4, r, seed=4) for r in range(5)]


def test_seeded_gumbel_noise_samples_the_processed_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -8.0]])
    no_tokens_yet = torch.zeros((1, 3), dtype=torch.long)
    draws = 4000
    counts = torch.zeros(5)
    for seed in range(draws):
        processor = sampling.SeededSampling([seed], temperature=1.0, top_k=0, top_p=1.0, prompt_width=3)
        counts[processor(no_tokens_yet, logits).argmax()] += 1
    assert torch.allclose(counts / draws, logits.softmax(-1)[0], atol=0.025)
    picks = {
        int(
            sampling.SeededSampling([seed], 0.5, top_k=2, top_p=1.0, prompt_width=3)(
                no_tokens_yet, logits
            ).argmax()
        )
        for seed in range(200)
    }
    assert picks == {0, 1}  # top_k keeps the two most likely tokens only, and both get drawn


def test_counter_noise_is_uniform_and_depends_on_seed_and_place_only():
    seeds = torch.tensor([7, 2**62 + 5])
    noise = sampling.counter_uniform(seeds, position=3, vocab=50_000)
    assert noise.min() > 0 and noise.max() < 1
    assert abs(float(noise.mean()) - 0.5) < 0.01 and abs(float(noise.var()) - 1 / 12) < 0.005
    assert torch.equal(noise[1:], sampling.counter_uniform(seeds[1:], 3, 50_000))  # without its batch
    assert not torch.equal(noise, sampling.counter_uniform(seeds, 4, 50_000))
    assert float(torch.corrcoef(noise)[0, 1]).__abs__() < 0.02


def test_a_completion_depends_on_its_seed_not_on_its_batch():
    model = micro_llama(vocab_size=64).eval()
    cfg = GrpoConfig(max_new_tokens=10, temperature=1.0)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3]]
    seeds = [sampling.completion_seed(42, 0, slot, slot, 0) for slot in range(3)]
    together = sampling.sample(model, prompts, seeds, cfg, pad_id=0, eos_id=1, synced=False)
    alone = [sampling.sample(model, [p], [s], cfg, 0, 1, False)[0] for p, s in zip(prompts, seeds)]
    assert together == alone
    assert sampling.sample(model, prompts, [s + 1 for s in seeds], cfg, 0, 1, False) != together
    assert sampling.completion_seed(42, 0, 1, 2, 3) != sampling.completion_seed(42, 0, 1, 2, 4)


def test_rewards_are_weighted_and_summed_and_a_users_function_loads(tmp_path):
    (tmp_path / "mine.py").write_text(
        "def shout(prompts, completions, answers):\n    return [1.5] * len(completions)\n"
    )
    cfg = GrpoConfig(
        rewards=["exact_answer", "format", "length", f"{tmp_path / 'mine.py'}:shout"],
        reward_weights=[1.0, 0.5, 2.0, -1.0],
        format_pattern=r"\d+",
        max_new_tokens=4,
    )
    rewards = Rewards.build(cfg)
    scores = rewards.score(["q", "q"], [" 12 ", "twelve"], ["12", "12"], lengths=[4, 6])
    assert scores["exact_answer"] == [1.0, 0.0] and scores["format"] == [1.0, 0.0]
    assert scores["length"] == [-1.0, -1.5] and scores["shout"] == [1.5, 1.5]
    assert scores["total"] == [1.0 + 0.5 - 2.0 - 1.5, 0.0 + 0.0 - 3.0 - 1.5]


def test_a_reward_function_must_return_one_finite_number_per_completion(tmp_path):
    (tmp_path / "bad.py").write_text("def short(prompts, completions, answers):\n    return [1.0]\n")
    rewards = Rewards.build(GrpoConfig(rewards=[f"{tmp_path / 'bad.py'}:short"]))
    with pytest.raises(UserError, match="short must return one finite number per completion"):
        rewards.score(["a", "b"], ["x", "y"], ["1", "2"], [1, 1])
    with pytest.raises(UserError, match="has no function missing"):
        Rewards.build(GrpoConfig(rewards=[f"{tmp_path / 'bad.py'}:missing"]))
    with pytest.raises(UserError, match="cannot import no_such_module"):
        Rewards.build(GrpoConfig(rewards=["no_such_module:f"]))


def test_advantages_are_normalised_per_group():
    totals = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    grouped = rollouts.advantages(totals, 4, "group")
    std = torch.tensor([1.0, 0.0, 0.0, 0.0]).std()
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + rollouts.STD_EPS)
    assert torch.allclose(grouped[:4], expected.double()) and torch.all(grouped[4:] == 0)
    assert torch.allclose(
        rollouts.advantages(totals, 4, "none")[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]).double()
    )
    batch = rollouts.advantages(totals, 4, "batch")
    assert torch.allclose(
        batch[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]).double() / (totals.std() + 1e-4)
    )


def _rollout(rows: int, seed: int = 0):
    """A round of `rows` completions of random tokens and lengths, with old and reference log-probs away
    from the policy's, so the ratio, the clipping and the KL all count."""
    gen = torch.Generator().manual_seed(seed)
    width = 6
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
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
        torch.randn(rows, generator=gen, dtype=torch.float64),
        -4 + 0.5 * torch.randn(rows, width, generator=gen, dtype=torch.float64),
        -4 + 0.5 * torch.randn(rows, width, generator=gen, dtype=torch.float64),
        torch.randperm(rows, generator=gen),
    )
    return rollout, prompts


def _step_gradient(model, rollout, prompts, cfg, micro: int, world: int) -> torch.Tensor:
    """The gradient a step leaves, its rows split into `world` processes of `micro`-row micro-batches (the
    processes simulated one after another, their gradients averaged as a backend does)."""
    from toolkit.grpo.config import GrpoRecipeConfig

    recipe = GrpoRecipeConfig(grpo=cfg)
    recipe.train.global_batch_size, recipe.train.micro_batch_size = len(rollout.prompt), micro
    rows = rollout.step_rows(1, recipe)
    tokens = int(rollout.lengths[rows].sum())
    accum = grad_accum_steps(recipe.train, world)
    scale = backward_scale(grpo_loss.normaliser(cfg, len(rows), tokens), accum, world)
    model.zero_grad()
    for rank in range(world):
        for batch in rollout.micro_batches(rows, prompts, recipe, 0, rank, world, "cpu"):
            terms = grpo_loss.micro_terms(cfg, grpo_loss.completion_logps(model, batch, 1.0), batch)
            (terms["objective"] * scale / accum / world).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo"])
def test_the_gradient_does_not_depend_on_the_split(loss):
    model = micro_llama().double()
    rollout, prompts = _rollout(8)
    cfg = GrpoConfig(loss=loss, beta=0.1, epsilon=0.1, max_new_tokens=6)
    whole = _step_gradient(model, rollout, prompts, cfg, micro=8, world=1)
    assert whole.abs().sum() > 0
    for micro, world in [(1, 1), (2, 2), (1, 4), (4, 2)]:
        split = _step_gradient(model, rollout, prompts, cfg, micro=micro, world=world)
        assert torch.allclose(split, whole, rtol=1e-10, atol=1e-12), (loss, micro, world)


def test_loss_variants_normalise_as_documented():
    model = micro_llama().double()
    rollout, prompts = _rollout(4, seed=1)
    rollout.old_logps = None  # on-policy: the ratio is exactly 1, the loss is minus the advantages' mean
    recipe = GrpoRecipeConfig()
    recipe.train.global_batch_size = recipe.train.micro_batch_size = 4
    (batch,) = rollout.micro_batches(torch.arange(4), prompts, recipe, 0, 0, 1, "cpu")
    logps = grpo_loss.completion_logps(model, batch, 1.0)
    lengths, advantages = rollout.lengths.double(), rollout.advantages
    for loss, expected in [
        ("grpo", -advantages.sum()),
        ("dapo", -(advantages * lengths).sum()),
        ("dr_grpo", -(advantages * lengths).sum() / 6),
    ]:
        terms = grpo_loss.micro_terms(GrpoConfig(loss=loss, max_new_tokens=6), logps, batch)
        assert float(terms["objective"].detach()) == pytest.approx(float(expected), rel=1e-9), loss
        assert float(terms["clipped"]) == 0 and float(terms["kl_sum"]) == 0


def test_engine_samples_are_weighted_by_the_trainers_probability_over_the_engines_truncated():
    """grpo.engine_is_cap: on-policy each token's term is minus its advantage, times min(p_trainer /
    p_engine, cap): here 4 (capped at 2), 0.5, 1 and 1 per completion; 0 turns the weighting off."""
    model = micro_llama().double()
    rollout, prompts = _rollout(4)
    rollout.old_logps = None
    recipe = GrpoRecipeConfig()
    recipe.train.global_batch_size = recipe.train.micro_batch_size = 4
    (plain,) = rollout.micro_batches(torch.arange(4), prompts, recipe, 0, 0, 1, "cpu")
    logps = grpo_loss.completion_logps(model, plain, 1.0).detach()
    shift = torch.tensor([4.0, 0.5, 1.0, 1.0], dtype=torch.float64).log()[:, None]
    rollout.engine_logps = torch.zeros(4, rollout.completions.size(1), dtype=torch.float64)
    rollout.engine_logps[:, : logps.size(1)] = logps - shift
    (batch,) = rollout.micro_batches(torch.arange(4), prompts, recipe, 0, 0, 1, "cpu")
    lengths, advantages = rollout.lengths.double(), rollout.advantages
    weights = torch.tensor([2.0, 0.5, 1.0, 1.0], dtype=torch.float64)
    for cap, expected in [
        (2.0, -(advantages * lengths * weights).sum()),
        (0.0, -(advantages * lengths).sum()),
    ]:
        cfg = GrpoConfig(loss="dapo", max_new_tokens=6, engine_is_cap=cap)
        terms = grpo_loss.micro_terms(cfg, grpo_loss.completion_logps(model, batch, 1.0), batch)
        assert float(terms["objective"].detach()) == pytest.approx(float(expected), rel=1e-9), cap
    assert torch.equal(
        rollouts.Rollout.from_state_dict(rollout.state_dict()).engine_logps, rollout.engine_logps
    )


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_engine_importance_weights_per_level_and_mode_are_the_documented_formulas(level, mode):
    """docs/grpo.md's table: per-token ratios 4, 0.25, 1.5 and 1 per completion, cap 2; a completion's
    sequence weight is its ratio to the power of its length. The logged sums are of the raw weights and of
    the tokens truncated or masked."""
    model = micro_llama().double()
    rollout, prompts = _rollout(4, seed=3)
    rollout.old_logps = None
    recipe = GrpoRecipeConfig()
    recipe.train.global_batch_size = recipe.train.micro_batch_size = 4
    (plain,) = rollout.micro_batches(torch.arange(4), prompts, recipe, 0, 0, 1, "cpu")
    logps = grpo_loss.completion_logps(model, plain, 1.0).detach()
    ratios = torch.tensor([4.0, 0.25, 1.5, 1.0], dtype=torch.float64)
    rollout.engine_logps = torch.zeros(4, rollout.completions.size(1), dtype=torch.float64)
    rollout.engine_logps[:, : logps.size(1)] = logps - ratios.log()[:, None]
    (batch,) = rollout.micro_batches(torch.arange(4), prompts, recipe, 0, 0, 1, "cpu")
    lengths, advantages = rollout.lengths.double(), rollout.advantages
    raw = ratios**lengths if level == "sequence" else ratios
    outside = (raw > 2) | (raw < 0.5) if mode == "mask" else raw > 2
    applied = raw.masked_fill(outside, 0.0) if mode == "mask" else raw.clamp(max=2.0)
    cfg = GrpoConfig(loss="dapo", max_new_tokens=6, engine_is_cap=2.0, engine_is_level=level)
    cfg.engine_is_mode = mode
    terms = grpo_loss.micro_terms(cfg, grpo_loss.completion_logps(model, batch, 1.0), batch)
    expected = -(advantages * lengths * applied).sum()
    assert float(terms["objective"].detach()) == pytest.approx(float(expected), rel=1e-9)
    assert float(terms["engine_is_weight"]) == pytest.approx(float((raw * lengths).sum()), rel=1e-9)
    assert float(terms["engine_is_outside"]) == float((outside.double() * lengths).sum())
    assert bool(outside.any()) and not bool(outside.all())  # both sides of the cap are exercised


def test_async_rounds_without_an_importance_cap_are_refused():
    with pytest.raises(UserError, match="grpo.async_rounds: 1 trains on samples of weights one round old"):
        load_grpo_config(None, ["grpo.generation=vllm", "grpo.async_rounds=1", "grpo.engine_is_cap=0"])


def test_completion_log_probs_are_the_models_own():
    model = micro_llama().double()
    rollout, prompts = _rollout(3)
    recipe = GrpoRecipeConfig()
    recipe.train.global_batch_size = recipe.train.micro_batch_size = 3
    (batch,) = rollout.micro_batches(torch.arange(3), prompts, recipe, 0, 0, 1, "cpu")
    got = grpo_loss.completion_logps(model, batch, 1.0).detach()
    for row in range(3):
        prompt = prompts.ids[int(rollout.prompt[row])]
        tokens = rollout.completions[row, : rollout.lengths[row]].tolist()
        logits = model(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1).detach()
        for j, token in enumerate(tokens):
            assert float(got[row, j]) == pytest.approx(float(logits[len(prompt) - 1 + j, token]), rel=1e-9)
        assert torch.all(got[row, len(tokens) :] == 0)


def test_a_rollout_survives_its_checkpoint_form():
    rollout, _ = _rollout(4)
    back = rollouts.Rollout.from_state_dict(rollout.state_dict())
    for key, value in rollout.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    recipe = GrpoRecipeConfig()
    recipe.grpo.steps_per_generation = 2
    assert rollouts.resumed(rollout.state_dict(), 1, recipe) is not None  # step 2: still round 0
    assert rollouts.resumed(rollout.state_dict(), 2, recipe) is None  # step 3 starts round 1
    assert rollouts.resumed({}, 1, recipe) is None


def test_the_commands_read_a_grpo_config_with_its_own_schema(tmp_path):
    from toolkit.commands.check_config import check_config_cli
    from toolkit.recipes import load_any_recipe_config

    cfg = load_any_recipe_config(REPO / "recipes" / "configs" / "demo-grpo.yaml")
    assert isinstance(cfg, GrpoRecipeConfig) and cfg.grpo.num_generations == 8
    accel = str(REPO / "accelerate_configs" / "zero3.yaml")
    report = check_config_cli(accel, str(REPO / "recipes" / "configs" / "demo-grpo.yaml"), None, {})
    assert "ok: deepspeed ZeRO-3 on 2 process(es)" in report


def test_a_full_fine_tune_from_a_start_adapter_trains_every_weight(tmp_path):
    from peft import LoraConfig, get_peft_model

    from toolkit.config import ModelConfig
    from toolkit.model.load import load_model

    base = micro_llama()
    base.save_pretrained(tmp_path / "base")
    get_peft_model(micro_llama(), LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(
        tmp_path / "sft"
    )
    spec = ModelConfig(path=str(tmp_path / "base"), method="full", adapter=str(tmp_path / "sft"))
    model = load_model(spec, None, 0)
    assert all(p.requires_grad for p in model.parameters())


def test_a_rounds_log_probs_are_scored_whatever_its_completions_lengths():
    model = micro_llama().double()
    rollout, prompts = _rollout(8, seed=2)
    assert len(set(rollout.lengths[:2].tolist())) > 1 or len(set(rollout.lengths[2:4].tolist())) > 1
    recipe = GrpoRecipeConfig(grpo=GrpoConfig(max_new_tokens=6))
    recipe.train.global_batch_size, recipe.train.micro_batch_size = 8, 2

    class Run:
        accelerator = OneProcess()

    table = rollouts.scored(Run(), model, rollout, prompts, recipe, 0, None)
    assert table.shape == (8, 6)
    recipe.train.micro_batch_size = 8
    (whole,) = rollout.micro_batches(torch.arange(8), prompts, recipe, 0, 0, 1, "cpu")
    expected = grpo_loss.completion_logps(model, whole, 1.0).detach()
    assert torch.allclose(table[:, : expected.size(1)], expected, rtol=1e-12)
    assert torch.all(table[:, expected.size(1) :] == 0)


@pytest.mark.parametrize(
    "override, message",
    [
        ("grpo.format_pattern=(a", "grpo.format_pattern: not a regular expression"),
        ("grpo.format_pattern=[", "override 'grpo.format_pattern=\\[': the value is not YAML"),
    ],
)
def test_a_bad_pattern_is_one_line_naming_it(override, message):
    with pytest.raises(UserError, match=message):
        load_grpo_config(None, ["model.adapter=null", override])
