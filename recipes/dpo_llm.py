"""Preference tuning of a causal language model (DPO, IPO, SimPO, ORPO, KTO): full or LoRA, on any backend.

    accelerate launch [--config_file accelerate_configs/<backend>.yaml] recipes/dpo_llm.py \\
        [--config recipes/configs/<run>.yaml] [dotted.key=value ...]

With no arguments it preference-tunes the SFT demo's result (runs/demo/final) on the embedded pairs
(recipes/configs/demo-dpo.yaml). Same set-up, resume, step machinery, checkpoints and export as
recipes/finetune_llm.py; what differs is the data (pairs) and the loss (toolkit/preference/).
"""

from __future__ import annotations

from toolkit import data
from toolkit.entry import config_sources, exit_with, recipe_args
from toolkit.preference import config as pref
from toolkit.preference import data as pairs
from toolkit.preference import evaluate, kto, reference, unpaired
from toolkit.preference import loss as pref_loss
from toolkit.preference import pipeline as pref_pipeline
from toolkit.run import Run
from toolkit.train import loss


def main(argv: list[str]) -> int:
    args = recipe_args(argv, __doc__, "recipes/configs/demo-dpo.yaml", "dpo.beta=0.2")
    cfg = pref.load_preference_config(args.config, args.overrides)
    with Run.start(cfg, config_sources(args, pref.DEMO_DPO_CONFIG), "dpo_llm") as run:
        return train(run, cfg)


def train(run: Run, cfg) -> int:
    accelerator = run.accelerator

    # Pairs and model: a stop here ends the run at once.
    with run.interruptible():
        tokenizer = run.chat_tokenizer()
        # KTO reads rows of one completion flagged desirable or not (pairs split into both kinds).
        rows_of_one = cfg.dpo.loss == "kto"
        build = unpaired.build_rows if rows_of_one else pairs.build_pairs
        train_set, eval_set, stats = build(
            cfg.data, tokenizer, pref.prompt_budget(cfg), cfg.seed, accelerator.main_process_first, run.images
        )
        accelerator.print(stats.summary())
        train_set = train_set.add_column("pair_index", list(range(len(train_set))))
        if eval_set is not None:
            eval_set = eval_set.add_column("pair_index", list(range(len(eval_set))))
        collate = pairs.PairCollator(tokenizer.pad_token_id, run.images)
        lengths = pairs.pair_lengths(train_set) if cfg.data.group_by_length else None
        loader, sampler = data.train_loader(
            train_set, cfg.data, cfg.train, tokenizer.pad_token_id, cfg.seed, False, collate, lengths
        )
        model = run.load_model()
        # pipeline.size > 1: this process keeps its stages' layers only; pairs are two rows each.
        pipeline = run.pipeline(model, tokenizer.pad_token_id, None, rows_per_example=2, uniform=False)
    optimizer, scheduler = run.optimizer(model)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    # The reference: adapter off, a separate frozen model, or log-probs computed before the policy moves.
    ref = reference.Reference.build(
        accelerator,
        model,
        cfg,
        run.features,
        {"train": train_set, "eval": eval_set},
        collate,
        fresh=run.resume.checkpoint is None,
        pipeline=pipeline,
    )
    if rows_of_one:
        evaluator = kto.RowEvaluator(accelerator, model, tokenizer, eval_set, collate, cfg, ref, run.log)
    else:
        evaluator = evaluate.PairEvaluator(
            accelerator, model, tokenizer, eval_set, collate, cfg, ref, run.log, pipeline
        )
    start_step = run.begin(model, evaluator)  # a checkpoint's state, or the starting point measured

    # The loop: one iteration per optimizer step, `grad_accum` micro-batches of pairs each; pair terms are
    # summed over the step's pairs, the chosen NLL over its chosen tokens, on every rank.
    model.train()
    for step, micro_batches in run.steps(loader, sampler, start_step, desc="dpo"):
        step_pairs, chosen_tokens, step_tokens = run.global_counts(
            [
                sum(data.count_rows(b) // 2 for b in micro_batches),
                sum(pref_loss.chosen_targets(b) for b in micro_batches),
                sum(int(b["attention_mask"].sum()) for b in micro_batches),
            ]
        )
        pair_scale = loss.backward_scale(step_pairs, run.grad_accum, run.gradient_ranks)
        token_scale = loss.backward_scale(chosen_tokens, run.grad_accum, run.gradient_ranks)
        if pipeline is not None:
            sums = pref_pipeline.pair_step(pipeline, micro_batches, ref, cfg.dpo, pair_scale, token_scale)
        elif rows_of_one:
            sums = kto.row_step(run, model, micro_batches, ref, cfg, pair_scale)
        else:
            sums = pref_loss.PairSums(accelerator.device)
            for batch in micro_batches:
                ref_logps = ref.logps(batch)
                with accelerator.accumulate(model), run.micro_batch() as router:
                    logps, counts = pref_loss.batch_sequence_logps(model, batch)
                    terms = pref_loss.pair_terms(cfg.dpo, logps, counts, ref_logps)
                    objective = pref_loss.micro_objective(terms, pair_scale, token_scale)
                    accelerator.backward(objective + router.loss(batch["attention_mask"]))
                    sums.add(terms, logps, counts)
        step_metrics = sums.reduce(accelerator).metrics()
        grad_norm = run.update(model, optimizer, scheduler, step, step_metrics["loss"])
        rows, per_second = 2 * step_pairs, {"rows" if rows_of_one else "pairs": step_pairs}
        run.log_step(step, scheduler, step_tokens, rows, per_second, **step_metrics, grad_norm=grad_norm)
        eval_result = evaluator.evaluate(step) if run.evaluating(step) else {}
        run.maybe_checkpoint(step, eval_result)
        if run.should_stop():
            return run.stopped(step)

    # Finish: final checkpoint, the measured result, the exported model.
    return run.finish(model, tokenizer, evaluator)


if __name__ == "__main__":
    exit_with(main, "dpo_llm")
