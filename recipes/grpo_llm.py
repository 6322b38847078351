"""Online RL with verifiable rewards (GRPO, Dr. GRPO, DAPO-style token loss): full or LoRA, on any backend.

    accelerate launch [--config_file accelerate_configs/<backend>.yaml] recipes/grpo_llm.py \\
        [--config recipes/configs/<run>.yaml] [dotted.key=value ...]

With no arguments it trains the SFT demo's result (runs/demo/final) on the embedded arithmetic prompts with
the exact-answer reward (recipes/configs/demo-grpo.yaml). Same set-up, resume, step machinery, checkpoints
and export as the other recipes; what differs lives in toolkit/grpo/: prompts, seeded sampling, rewards,
rollouts and the clipped policy-ratio loss.
"""

from __future__ import annotations

import torch

from toolkit import distributed
from toolkit.entry import config_sources, exit_with, recipe_args
from toolkit.grpo import config as grpo_config
from toolkit.grpo import engine_start, held_out
from toolkit.grpo import environment as environments
from toolkit.grpo import loss as grpo_loss
from toolkit.grpo import prompts as prompt_sets
from toolkit.grpo import rollout as rollouts
from toolkit.grpo import teacher as teachers
from toolkit.grpo.engine import EngineLost, EngineSampler
from toolkit.grpo.rewards import Rewards
from toolkit.run import Run
from toolkit.train import evaluate, loss


def main(argv: list[str]) -> int:
    args = recipe_args(argv, __doc__, "recipes/configs/demo-grpo.yaml", "grpo.num_generations=8")
    cfg = grpo_config.load_grpo_config(args.config, args.overrides)
    engine_start.check_engine_environment(cfg)  # before Run.start writes output_dir
    teachers.check_tokenizers(cfg)  # a teacher reading other token ids is refused before the run writes
    with (
        Run.start(cfg, config_sources(args, grpo_config.DEMO_GRPO_CONFIG), "grpo_llm") as run,
        EngineSampler.started(run, cfg) as engine,  # None unless grpo.generation names an engine
        environments.started(run, cfg) as environment,  # tools, an OpenEnv server, or None: single-turn
        run.saved_when(EngineLost),  # an engine lost mid-run, not restarted: the steps saved, one line
    ):
        return train(run, cfg, engine, environment)


def train(run: Run, cfg, engine, environment) -> int:
    accelerator = run.accelerator

    # A user's reward function is imported, and a reward model loaded, before anything else loads.
    rewards = Rewards.build(cfg.grpo, accelerator.device)

    # Prompts (every SFT layout: the last assistant turn is the reference answer) and model.
    with run.interruptible():
        tokenizer, train_set, eval_set = run.chat_data()
        rewards.check_tokenizer(tokenizer)
        prompts = prompt_sets.prompt_set(train_set, tokenizer, opening=environment is not None)
        eval_loader = run.eval_loader(eval_set, tokenizer.pad_token_id)
        model = run.load_model()
    optimizer, scheduler = run.optimizer(model)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    reference = grpo_loss.Reference.build(accelerator, model, cfg, run.features)  # None when grpo.beta is 0
    teacher = teachers.Teacher.build(accelerator, cfg, run.features)  # None without grpo.teacher
    # With an environment, whole held-out conversations are scored (grpo/held_out.py), not first turns.
    conversations = held_out.ConversationEval.build(accelerator, cfg, tokenizer, eval_set, environment)
    evaluator = evaluate.Evaluator(
        accelerator, model, tokenizer, eval_loader, eval_set, cfg.eval, run.log, conversations=conversations
    )
    start_step = run.begin(model, evaluator)  # a checkpoint's state, or the starting point measured

    # A checkpoint keeps the round in progress (and one sent ahead), so a resumed run trains on the very
    # same completions.
    rollout = rollouts.resumed(run.resume.recipe_state(), start_step, cfg, engine)
    run.recipe_state = lambda: rollouts.recipe_state(rollout, engine)
    stats = rollouts.StepStats(cfg)
    rank, world = distributed.data_shard(accelerator)  # tensor-parallel ranks share their completions

    # The loop: a generation round every grpo.steps_per_generation x grpo.iterations steps (G sampled
    # completions per prompt, rewarded, advantages normalised per group); each step trains on its share.
    model.train()
    for step in run.step_numbers(start_step, desc="grpo"):
        if rollout is None or rollout.round_index != rollouts.round_of(step, cfg):
            round_index = rollouts.round_of(step, cfg)
            rollout = rollouts.generate(
                run, model, prompts, rewards, cfg, tokenizer, round_index, reference, engine, environment
            )
            teachers.score(run, model, rollout, prompts, cfg, tokenizer.pad_token_id, teacher)
        rows = rollout.step_rows(step, cfg)
        completion_tokens, step_tokens = rollouts.step_counts(rollout, rows, prompts)
        normaliser = grpo_loss.normaliser(cfg.grpo, len(rows), completion_tokens)
        scale = loss.backward_scale(normaliser, run.grad_accum, run.gradient_ranks)
        sums = torch.zeros(grpo_loss.SUMMED_TERMS, dtype=torch.float64, device=accelerator.device)
        micro_batches = rollout.micro_batches(
            rows, prompts, cfg, tokenizer.pad_token_id, rank, world, accelerator.device
        )
        for batch in micro_batches:
            with accelerator.accumulate(model), run.micro_batch() as router:
                logps = grpo_loss.completion_logps(model, batch, cfg.grpo.temperature)
                terms = grpo_loss.micro_terms(cfg.grpo, logps, batch)
                accelerator.backward(terms["objective"] * scale + router.loss(batch["attention_mask"]))
                sums += torch.stack([t.detach().double() for t in terms.values()])
        step_metrics = stats.metrics(rollout, rows, run.global_sum(sums).cpu(), completion_tokens)
        grad_norm = run.update(model, optimizer, scheduler, step, step_metrics["loss"])
        per_second = {"completions": len(rows)}
        run.log_step(step, scheduler, step_tokens, len(rows), per_second, **step_metrics, grad_norm=grad_norm)
        eval_result = evaluator.evaluate(step) if run.evaluating(step) else {}
        run.maybe_checkpoint(step, eval_result)
        if run.should_stop():
            return run.stopped(step)

    # Finish: final checkpoint, the measured result, the exported model.
    return run.finish(model, tokenizer, evaluator)


if __name__ == "__main__":
    exit_with(main, "grpo_llm")
