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
    export,
    flops,
    launch_check,
    loss,
    metrics,
    optim,
    portable,
    speed,
)
from toolkit import model as models
from toolkit.config import flat_dict, load_config
from toolkit.errors import UserError
from toolkit.nonfinite import NonFiniteGuard
from toolkit.preemption import PREEMPTED_EXIT_CODE, StopRequest

DEMO_CONFIG = Path(__file__).resolve().parent / "configs" / "demo.yaml"


def main(argv: list[str]) -> int:
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
    resume_from = checkpoint.resolve_resume(output_dir, cfg.train.resume, cfg.train.overwrite)
    checkpoint.prepare_output_dir(accelerator, output_dir, cfg, fresh=resume_from is None)
    if cfg.log.trackers:
        accelerator.init_trackers(cfg.log.project, config=flat_dict(cfg))

    # Data and model.
    tokenizer = models.load_tokenizer(cfg.model)
    data.ensure_chat_template(tokenizer)
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
    # Resuming under another backend or world size: the checkpoint goes into the plain model, before prepare.
    marker = checkpoint.read_marker(resume_from) if resume_from is not None else None
    layout = checkpoint.layout(accelerator)
    exact = marker is not None and portable.resume_plan(marker, layout) == "exact"
    if marker is not None and not exact:
        accelerator.print(portable.restore_portable(resume_from, model, optimizer, scheduler, layout))
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)

    # Where to start: a checkpoint, or a fresh run whose starting point is measured first.
    start_step, tokens_seen = 0, 0
    log = metrics.MetricsLog(
        output_dir / "metrics.jsonl",
        accelerator.is_main_process,
        accelerator.log if cfg.log.trackers else None,
    )
    evaluator = evaluate.Evaluator(accelerator, model, tokenizer, eval_loader, eval_set, cfg.eval, log)
    if marker is not None:
        if exact:
            checkpoint.load_checkpoint(accelerator, resume_from, model, optimizer)
        start_step, tokens_seen = marker["step"], marker["tokens_seen"]
        if accelerator.is_main_process:
            metrics.truncate_after(log.path, start_step)
        accelerator.print(f"resumed from {resume_from} at step {start_step}")
    else:
        evaluator.report(0, "before")

    # The loop: one iteration per optimizer step, `grad_accum` micro-batches each.
    stream = batches.StepStream(train_loader, sampler, grad_accum, start_step, accelerator.skip_first_batches)
    schedule = checkpoint.SaveSchedule(cfg.train.save_every_steps, cfg.train.save_every_minutes, start_step)
    guard = NonFiniteGuard(
        cfg.train.nonfinite, cfg.train.nonfinite_patience, can_skip=launch.backend != "deepspeed"
    )
    stop = StopRequest()
    progress = tqdm(
        initial=start_step, total=cfg.train.max_steps, disable=not accelerator.is_main_process, desc="train"
    )
    model.train()
    for step in range(start_step + 1, cfg.train.max_steps + 1):
        started = time.perf_counter()
        micro_batches = stream.next_step()
        data_wait = time.perf_counter() - started
        counts = torch.tensor(
            [
                sum(loss.count_targets(b["labels"]) for b in micro_batches),
                sum(data.count_tokens(b) for b in micro_batches),
                sum(len(b["input_ids"]) for b in micro_batches),
            ],
            device=accelerator.device,
        )
        step_targets, step_tokens, step_rows = accelerator.reduce(counts, reduction="sum").tolist()
        scale = loss.backward_scale(step_targets, grad_accum, accelerator.num_processes)
        loss_sum = torch.zeros((), device=accelerator.device)
        for batch in micro_batches:
            with accelerator.accumulate(model):
                logits = model(**data.model_inputs(batch)).logits
                micro_loss = loss.summed_token_loss(logits, batch["labels"])
                accelerator.backward(micro_loss * scale)
                loss_sum += micro_loss.detach()
        step_loss = accelerator.reduce(loss_sum, reduction="sum").item() / max(step_targets, 1)
        grad_norm = float(distributed.clip_grad_norm(accelerator, model, cfg.train.max_grad_norm))
        if guard.allows_update(step, step_loss, grad_norm):
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad()
        tokens_seen += step_tokens
        elapsed = time.perf_counter() - started
        if step % cfg.train.log_every_steps == 0 or step == cfg.train.max_steps:
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
        if cfg.train.eval_every_steps and step % cfg.train.eval_every_steps == 0:
            eval_result = evaluator.evaluate(step)
        stopping, save_due = distributed.any_rank(
            accelerator, stop.requested or bool(guard.failure), schedule.due(step)
        )
        if (save_due or stopping) and guard.weights_intact:
            checkpoint.save_checkpoint(
                accelerator,
                output_dir,
                step,
                {"tokens_seen": tokens_seen, "eval_loss": eval_result.get("eval_loss")},
                cfg,
            )
            schedule.saved(step)
            if accelerator.is_main_process and (cfg.train.keep_last or cfg.train.keep_best):
                checkpoint.prune_checkpoints(output_dir, cfg.train.keep_last, cfg.train.keep_best)
        if stopping:
            progress.close()
            if guard.failure:
                raise UserError(guard.failure)
            accelerator.print(
                f"stopped by {stop.signal_name or 'another rank'} after step {step}; checkpoint saved, "
                "launch again with train.resume=auto to continue"
            )
            return PREEMPTED_EXIT_CODE
    progress.close()

    # Finish: final checkpoint, the measured result, the exported model.
    if schedule.last_step < cfg.train.max_steps:
        checkpoint.save_checkpoint(
            accelerator, output_dir, cfg.train.max_steps, {"tokens_seen": tokens_seen}, cfg
        )
    evaluator.report(cfg.train.max_steps, "after")
    final_dir = output_dir / "final"
    export.export_model(accelerator, model, tokenizer, final_dir, cfg.export.dtype)
    if cfg.export.merge and cfg.model.method != "full" and accelerator.is_main_process:
        export.merge_adapter(final_dir, final_dir / "merged", cfg.export.dtype)
    accelerator.wait_for_everyone()
    accelerator.print(
        f"saved: {final_dir.resolve()}  (try: ftkit generate --model {final_dir} --prompt '...')"
    )
    accelerator.end_training()
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="recipe config YAML (default: recipes/configs/demo.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.max_steps=20")
    return parser.parse_args(argv)


if __name__ == "__main__":
    console.quiet_third_party()
    error = ""
    try:
        exit_code = main(sys.argv[1:])
    except UserError as exc:
        exit_code, error = 2, str(exc)
    finally:
        distributed.close()  # also after a preemption stop or an error, so the exit code gets out
    sys.exit(console.finish("finetune_llm", exit_code, error))
