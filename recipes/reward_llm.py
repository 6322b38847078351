"""Reward model training: a causal language model with a scalar head on preference pairs (Bradley-Terry),
full or LoRA (the head trained whole beside the adapter), on any backend.

    accelerate launch [--config_file accelerate_configs/<backend>.yaml] recipes/reward_llm.py \\
        [--config recipes/configs/<run>.yaml] [dotted.key=value ...]

With no arguments it trains a reward model from the SFT demo's result (runs/demo/final) on the embedded
pairs (recipes/configs/demo-rm.yaml). The pairs are the preference recipe's (toolkit/preference/data.py);
set-up, resume, step machinery, checkpoints and export are every recipe's; the loss and the held-out
pairwise accuracy are toolkit/reward/'s.
"""

from __future__ import annotations

from toolkit import data
from toolkit.entry import config_sources, exit_with, recipe_args
from toolkit.errors import UserError
from toolkit.preference import data as pairs
from toolkit.reward import config as rm
from toolkit.reward import evaluate
from toolkit.reward import loss as rm_loss
from toolkit.run import Run
from toolkit.train import loss


def main(argv: list[str]) -> int:
    args = recipe_args(argv, __doc__, "recipes/configs/demo-rm.yaml", "reward.center_coefficient=0.01")
    cfg = rm.load_reward_config(args.config, args.overrides)
    with Run.start(cfg, config_sources(args, rm.DEMO_RM_CONFIG), "reward_llm") as run:
        return train(run, cfg)


def train(run: Run, cfg) -> int:
    accelerator = run.accelerator
    if run.launch.mesh.sp > 1:
        raise UserError("sequence parallelism: a reward model scores whole rows; launch without sp")

    # Pairs and model: a stop here ends the run at once.
    with run.interruptible():
        tokenizer = run.chat_tokenizer()
        if run.images is not None:
            raise UserError(
                f"model.path: {cfg.model.path} is a vision-language model; reward models are text"
            )
        train_set, eval_set, stats = pairs.build_pairs(
            cfg.data, tokenizer, rm.prompt_budget(cfg), cfg.seed, accelerator.main_process_first
        )
        accelerator.print(stats.summary())
        collate = pairs.PairCollator(tokenizer.pad_token_id)
        lengths = pairs.pair_lengths(train_set) if cfg.data.group_by_length else None
        loader, sampler = data.train_loader(
            train_set, cfg.data, cfg.train, tokenizer.pad_token_id, cfg.seed, False, collate, lengths
        )
        model = run.load_model(scalar_head=True)
        # The score is read at each row's last token before its padding, in training as in any tool that
        # loads the export.
        model.config.pad_token_id = tokenizer.pad_token_id
    optimizer, scheduler = run.optimizer(model)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    evaluator = evaluate.RewardEvaluator(accelerator, model, eval_set, collate, cfg, run.log)
    start_step = run.begin(model, evaluator)  # a checkpoint's state, or the starting point measured

    # The loop: one iteration per optimizer step, `grad_accum` micro-batches of pairs each; pair losses
    # are summed over the step's pairs on every rank.
    model.train()
    for step, micro_batches in run.steps(loader, sampler, start_step, desc="rm"):
        step_pairs, step_tokens = run.global_counts(
            [
                sum(data.count_rows(b) // 2 for b in micro_batches),
                sum(int(b["attention_mask"].sum()) for b in micro_batches),
            ]
        )
        pair_scale = loss.backward_scale(step_pairs, run.grad_accum, run.gradient_ranks)
        sums = rm_loss.RewardSums(accelerator.device)
        for batch in micro_batches:
            with accelerator.accumulate(model), run.micro_batch() as router:
                rewards = rm_loss.batch_rewards(model, batch)
                terms = rm_loss.reward_terms(cfg.reward, rewards, batch["margin"])
                accelerator.backward(terms.losses.sum() * pair_scale + router.loss(batch["attention_mask"]))
                sums.add(terms)
        step_metrics = sums.reduce(accelerator).metrics()
        grad_norm = run.update(model, optimizer, scheduler, step, step_metrics["loss"])
        rows, per_second = 2 * step_pairs, {"pairs": step_pairs}
        run.log_step(step, scheduler, step_tokens, rows, per_second, **step_metrics, grad_norm=grad_norm)
        eval_result = evaluator.evaluate(step) if run.evaluating(step) else {}
        run.maybe_checkpoint(step, eval_result)
        if run.should_stop():
            return run.stopped(step)

    # Finish: final checkpoint, the measured result, the exported model.
    return run.finish(model, tokenizer, evaluator)


if __name__ == "__main__":
    exit_with(main, "reward_llm")
