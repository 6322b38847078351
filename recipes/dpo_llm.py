"""Preference tuning of a causal language model (DPO, IPO, SimPO, ORPO): full or LoRA, on any backend.

    accelerate launch [--config_file accelerate_configs/<backend>.yaml] recipes/dpo_llm.py \\
        [--config recipes/configs/<run>.yaml] [dotted.key=value ...]

With no arguments it preference-tunes the SFT demo's result (runs/demo/final) on the embedded pairs
(recipes/configs/demo-dpo.yaml). Same set-up, resume, step machinery, checkpoints and export as
recipes/finetune_llm.py; what differs is the data (pairs) and the loss (toolkit/preference/).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from toolkit import (
    batches,
    checkpoint,
    console,
    distributed,
    flops,
    launch_check,
    loss,
    metrics,
    optim,
    rundir,
    speed,
    steps,
)
from toolkit import model as models
from toolkit.config import flat_dict
from toolkit.data import model_inputs
from toolkit.data.loader import train_loader
from toolkit.errors import run_main
from toolkit.nonfinite import NonFiniteGuard
from toolkit.preemption import PREEMPTED_EXIT_CODE, StopRequest
from toolkit.preference import config as pref
from toolkit.preference import data as pairs
from toolkit.preference import evaluate, reference
from toolkit.preference import loss as pref_loss
from toolkit.resume import Resume


def main(argv: list[str]) -> int:
    stop = StopRequest()  # first, so a stop while loading or evaluating exits cleanly
    args = parse_args(argv)
    cfg = pref.load_preference_config(args.config, args.overrides)
    output_dir = Path(cfg.output_dir)

    # Backend: whatever `accelerate launch` was told; checked, never silently degraded to lone ranks.
    launch = distributed.detect_launch()
    notes = launch_check.check_launch(
        launch, cfg, args.config or str(pref.DEMO_DPO_CONFIG), launch_check.probe_machine(), os.environ
    )
    grad_accum = batches.grad_accum_steps(cfg.train, launch.world_size)
    accelerator = distributed.setup(
        launch,
        cfg.train,
        grad_accum,
        log_with=cfg.log.trackers or None,
        project_dir=str(output_dir),
        step_scheduler_with_optimizer=False,
    )
    features = speed.resolve(cfg.model, cfg.train, accelerator.device)
    summary = distributed.setup_summary(accelerator, launch, cfg.train, grad_accum)
    for line in [summary, *notes, *features.notes]:
        accelerator.print(line)
    set_seed(cfg.seed)
    run_lock = rundir.claim(accelerator, output_dir)  # held until the process ends, however it ends
    resume = Resume.find(output_dir, cfg, say=accelerator.print)
    rundir.prepare_output_dir(accelerator, output_dir, cfg, fresh=resume.new_run)
    if cfg.log.trackers:
        accelerator.init_trackers(cfg.log.project, config=flat_dict(cfg))

    # Pairs and model.
    tokenizer = models.load_tokenizer(cfg.model)
    with stop.interruptible(f"step {resume.next_step}"):
        train_set, eval_set, stats = pairs.build_pairs(
            cfg.data, tokenizer, pref.prompt_budget(cfg), cfg.seed, accelerator.main_process_first
        )
    accelerator.print(stats.summary())
    train_set = train_set.add_column("pair_index", list(range(len(train_set))))
    if eval_set is not None:
        eval_set = eval_set.add_column("pair_index", list(range(len(eval_set))))
    collate = pairs.PairCollator(tokenizer.pad_token_id)
    loader, sampler = train_loader(
        train_set,
        cfg.data,
        cfg.train,
        tokenizer.pad_token_id,
        cfg.seed,
        False,
        collate,
        lengths=pairs.pair_lengths(train_set) if cfg.data.group_by_length else None,
    )
    model = models.load_model(cfg.model, cfg.lora, accelerator.local_process_index, features)
    trainable, total = models.trainable_and_total(model)
    accelerator.print(
        f"model: {cfg.model.path} ({cfg.model.method}), {trainable:,} of {total:,} parameters trained"
    )
    meter = metrics.StepSpeed(flops.ModelShape.of(model), accelerator.device, accelerator.num_processes)
    optimizer = optim.build_optimizer(model, cfg.train, accelerator.num_processes, features.fused_adamw)
    scheduler = optim.build_scheduler(optimizer, cfg.train)
    resume.before_prepare(model, optimizer, scheduler, accelerator)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    # The reference: adapter off, a separate frozen model, or log-probs computed before the policy moves.
    ref = reference.Reference.build(
        accelerator,
        model,
        cfg,
        features,
        {"train": train_set, "eval": eval_set},
        collate,
        fresh=resume.checkpoint is None,
    )

    # Where to start: a checkpoint, or a fresh run whose starting point is measured first.
    log = metrics.MetricsLog(
        output_dir / "metrics.jsonl",
        accelerator.is_main_process,
        accelerator.log if cfg.log.trackers else None,
    )
    evaluator = evaluate.PairEvaluator(accelerator, model, tokenizer, eval_set, collate, cfg, ref, log)
    start_step, tokens_seen = resume.after_prepare(accelerator, log, model)
    if resume.checkpoint is None and not stop.agreed(accelerator):
        evaluator.report(0, "before")
    if stop.agreed(accelerator):  # stopped while loading or evaluating: nothing new to save
        accelerator.print(f"stopped by {stop.signal_name or 'another rank'} before step {start_step + 1}")
        return PREEMPTED_EXIT_CODE

    # The loop: one iteration per optimizer step, `grad_accum` micro-batches of pairs each.
    stream = batches.StepStream(loader, sampler, grad_accum, start_step, accelerator.skip_first_batches)
    schedule = checkpoint.SaveSchedule(cfg.train.save_every_steps, cfg.train.save_every_minutes, start_step)
    guard = NonFiniteGuard(
        cfg.train.nonfinite, cfg.train.nonfinite_patience, can_skip=launch.backend != "deepspeed"
    )
    progress = tqdm(
        initial=start_step, total=cfg.train.max_steps, disable=not accelerator.is_main_process, desc="dpo"
    )
    model.train()
    for step in range(start_step + 1, cfg.train.max_steps + 1):
        started = time.perf_counter()
        micro_batches = stream.next_step()
        data_wait = time.perf_counter() - started
        step_pairs, chosen_tokens, step_tokens = steps.global_counts(
            accelerator,
            [
                sum(len(b["pair_index"]) for b in micro_batches),
                sum(loss.count_targets(b["labels"].chunk(2)[0]) for b in micro_batches),
                sum(int(b["attention_mask"].sum()) for b in micro_batches),
            ],
        )
        pair_scale = loss.backward_scale(step_pairs, grad_accum, accelerator.num_processes)
        token_scale = loss.backward_scale(chosen_tokens, grad_accum, accelerator.num_processes)
        sums = torch.zeros(8, dtype=torch.float64, device=accelerator.device)
        for batch in micro_batches:
            ref_logps = ref.logps(batch)
            with accelerator.accumulate(model):
                logps, counts = pref_loss.sequence_logps(model(**model_inputs(batch)).logits, batch["labels"])
                terms = pref_loss.pair_terms(cfg.dpo, logps, counts, ref_logps)
                accelerator.backward(pref_loss.micro_objective(terms, pair_scale, token_scale))
                sums += pref_loss.pair_stats(terms, logps)
        step_metrics = pref_loss.step_metrics(
            accelerator.reduce(sums, reduction="sum").tolist(), step_pairs, chosen_tokens
        )
        grad_norm = steps.apply_update(
            accelerator,
            model,
            optimizer,
            scheduler,
            guard,
            step,
            step_metrics["loss"],
            cfg.train.max_grad_norm,
        )
        tokens_seen += step_tokens
        elapsed = time.perf_counter() - started
        if steps.every(step, cfg.train.log_every_steps, cfg.train.max_steps):
            lr = scheduler.get_last_lr()[0]
            measured = meter.measure(step_tokens, 2 * step_pairs, elapsed, data_wait)
            log.write(
                step,
                **step_metrics,
                lr=lr,
                grad_norm=grad_norm,
                pairs_per_s=step_pairs / elapsed,
                tokens_seen=tokens_seen,
                skipped_steps=guard.skipped,
                **measured,
            )
            fields = metrics.progress_fields(step_metrics["loss"], lr, measured)
            progress.set_postfix({**fields, "acc": f"{step_metrics['reward_accuracy']:.2f}"})
        progress.update(1)
        eval_result = evaluator.evaluate(step) if steps.every(step, cfg.train.eval_every_steps) else {}
        state = {"tokens_seen": tokens_seen, "eval_loss": eval_result.get("eval_loss")}
        exit_code = steps.end_of_step(
            accelerator, cfg, output_dir, step, state, schedule, guard, stop, progress
        )
        if exit_code is not None:
            return exit_code
    progress.close()

    # Finish: final checkpoint, the measured result, the exported model.
    steps.final_checkpoint(accelerator, cfg, output_dir, schedule, {"tokens_seen": tokens_seen})
    evaluator.report(cfg.train.max_steps, "after")
    steps.export_final(accelerator, model, tokenizer, cfg, output_dir)
    accelerator.end_training()
    run_lock.release()
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="recipe config YAML (default: recipes/configs/demo-dpo.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. dpo.beta=0.2")
    return parser.parse_args(argv)


if __name__ == "__main__":
    console.quiet_third_party()
    try:
        exit_code = run_main(main, sys.argv[1:], "dpo_llm")
    finally:
        distributed.close()  # also after a preemption stop or an error, so the exit code gets out
    sys.exit(exit_code)
