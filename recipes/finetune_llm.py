"""Supervised fine-tuning of a causal language model: full, LoRA or QLoRA, on any Accelerate backend.

    accelerate launch [--config_file accelerate_configs/<backend>.yaml] recipes/finetune_llm.py \
        [--config recipes/configs/<run>.yaml] [dotted.key=value ...]

With no arguments it fine-tunes the embedded tiny model on the embedded demo data (recipes/configs/demo.yaml).
The backend (single process, DDP, FSDP, ZeRO-1/2/3, offload) comes from the accelerate config alone.
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
    data,
    distributed,
    evaluate,
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
from toolkit.config import flat_dict, load_config
from toolkit.errors import run_main
from toolkit.nonfinite import NonFiniteGuard
from toolkit.preemption import PREEMPTED_EXIT_CODE, StopRequest
from toolkit.resume import Resume

DEMO_CONFIG = Path(__file__).resolve().parent / "configs" / "demo.yaml"


def main(argv: list[str]) -> int:
    # First: a stop while loading or evaluating exits cleanly, and a launcher stopping the other ranks after
    # one failed leaves the main process time to say why.
    stop = StopRequest()
    args = parse_args(argv)
    cfg = load_config(args.config or DEMO_CONFIG, args.overrides)
    output_dir = Path(cfg.output_dir)

    # Backend: whatever `accelerate launch` was told; checked, never silently degraded to lone ranks.
    launch = distributed.detect_launch()
    notes = launch_check.check_launch(
        launch, cfg, args.config or "recipes/configs/demo.yaml", launch_check.probe_machine(), os.environ
    )
    grad_accum = batches.grad_accum_steps(cfg.train, launch.world_size)
    accelerator = distributed.setup(
        launch,
        cfg.train,
        grad_accum,
        log_with=cfg.log.trackers or None,
        project_dir=str(output_dir),
        step_scheduler_with_optimizer=False,  # one scheduler step per optimizer step, whatever the world size
    )
    features = speed.resolve(cfg.model, cfg.train, accelerator.device)
    for line in [
        distributed.setup_summary(accelerator, launch, cfg.train, grad_accum),
        *notes,
        *features.notes,
    ]:
        accelerator.print(line)
    set_seed(cfg.seed)
    run_lock = rundir.claim(accelerator, output_dir)  # held until the process ends, however it ends
    resume = Resume.find(output_dir, cfg, say=accelerator.print)
    rundir.prepare_output_dir(accelerator, output_dir, cfg, fresh=resume.new_run)
    if cfg.log.trackers:
        accelerator.init_trackers(cfg.log.project, config=flat_dict(cfg))

    # Data and model.
    tokenizer = models.load_tokenizer(cfg.model)
    data.ensure_chat_template(tokenizer)
    with stop.interruptible(f"step {resume.next_step}"):
        train_set, eval_set, stats = data.build_datasets(
            cfg.data, tokenizer, cfg.seed, accelerator.main_process_first
        )
    accelerator.print(stats.summary())
    train_loader, sampler = data.train_loader(
        train_set,
        cfg.data,
        cfg.train,
        tokenizer.pad_token_id,
        cfg.seed,
        flash_varlen=features.attention == "flash_attention_2",
    )
    eval_loader = None  # each rank its own share, so it is not given to prepare
    if eval_set is not None:
        eval_loader = data.eval_loader(
            eval_set,
            accelerator.process_index,
            accelerator.num_processes,
            cfg.train.micro_batch_size,
            tokenizer.pad_token_id,
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
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)

    # Where to start: a checkpoint, or a fresh run whose starting point is measured first.
    log = metrics.MetricsLog(
        output_dir / "metrics.jsonl",
        accelerator.is_main_process,
        accelerator.log if cfg.log.trackers else None,
    )
    evaluator = evaluate.Evaluator(accelerator, model, tokenizer, eval_loader, eval_set, cfg.eval, log)
    start_step, tokens_seen = resume.after_prepare(accelerator, log, model)
    if resume.checkpoint is None and not stop.agreed(accelerator):
        evaluator.report(0, "before")
    if stop.agreed(accelerator):  # stopped while loading or evaluating: nothing new to save
        accelerator.print(f"stopped by {stop.signal_name or 'another rank'} before step {start_step + 1}")
        return PREEMPTED_EXIT_CODE

    # The loop: one iteration per optimizer step, `grad_accum` micro-batches each.
    stream = batches.StepStream(train_loader, sampler, grad_accum, start_step, accelerator.skip_first_batches)
    schedule = checkpoint.SaveSchedule(cfg.train.save_every_steps, cfg.train.save_every_minutes, start_step)
    guard = NonFiniteGuard(
        cfg.train.nonfinite, cfg.train.nonfinite_patience, can_skip=launch.backend != "deepspeed"
    )
    progress = tqdm(
        initial=start_step, total=cfg.train.max_steps, disable=not accelerator.is_main_process, desc="train"
    )
    model.train()
    for step in range(start_step + 1, cfg.train.max_steps + 1):
        started = time.perf_counter()
        micro_batches = stream.next_step()
        data_wait = time.perf_counter() - started
        step_targets, step_tokens, step_rows = steps.global_counts(
            accelerator,
            [
                sum(loss.count_targets(b["labels"]) for b in micro_batches),
                sum(data.count_tokens(b) for b in micro_batches),
                sum(len(b["input_ids"]) for b in micro_batches),
            ],
        )
        scale = loss.backward_scale(step_targets, grad_accum, accelerator.num_processes)
        loss_sum = torch.zeros((), device=accelerator.device)
        for batch in micro_batches:
            with accelerator.accumulate(model):
                logits = model(**data.model_inputs(batch)).logits
                micro_loss = loss.summed_token_loss(logits, batch["labels"])
                accelerator.backward(micro_loss * scale)
                loss_sum += micro_loss.detach()
        step_loss = accelerator.reduce(loss_sum, reduction="sum").item() / max(step_targets, 1)
        grad_norm = steps.apply_update(
            accelerator, model, optimizer, scheduler, guard, step, step_loss, cfg.train.max_grad_norm
        )
        tokens_seen += step_tokens
        elapsed = time.perf_counter() - started
        if steps.every(step, cfg.train.log_every_steps, cfg.train.max_steps):
            lr = scheduler.get_last_lr()[0]
            measured = meter.measure(step_tokens, step_rows, elapsed, data_wait)
            log.write(
                step,
                loss=step_loss,
                lr=lr,
                grad_norm=grad_norm,
                tokens_seen=tokens_seen,
                skipped_steps=guard.skipped,
                **measured,
            )
            progress.set_postfix(metrics.progress_fields(step_loss, lr, measured))
        progress.update(1)
        eval_result = {}
        if steps.every(step, cfg.train.eval_every_steps):
            eval_result = evaluator.evaluate(step)
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
    parser.add_argument("--config", help="recipe config YAML (default: recipes/configs/demo.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.max_steps=20")
    return parser.parse_args(argv)


if __name__ == "__main__":
    console.quiet_third_party()
    try:
        exit_code = run_main(main, sys.argv[1:], "finetune_llm")
    finally:
        distributed.close()  # also after a preemption stop or an error, so the exit code gets out
    sys.exit(exit_code)
