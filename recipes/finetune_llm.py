"""Supervised fine-tuning of a causal language model: full, LoRA or QLoRA, on any Accelerate backend.

    accelerate launch [--config_file accelerate_configs/<backend>.yaml] recipes/finetune_llm.py \
        [--config recipes/configs/<run>.yaml] [dotted.key=value ...]

With no arguments it fine-tunes the embedded tiny model on the embedded demo data (recipes/configs/demo.yaml).
The backend (single process, DDP, FSDP, ZeRO-1/2/3, offload) comes from the accelerate config alone.
"""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit import data
from toolkit.config import load_config
from toolkit.entry import config_sources, exit_with, recipe_args
from toolkit.run import Run
from toolkit.train import evaluate, loss

DEMO_CONFIG = Path(__file__).resolve().parent / "configs" / "demo.yaml"


def main(argv: list[str]) -> int:
    args = recipe_args(argv, __doc__, "recipes/configs/demo.yaml", "train.max_steps=20")
    cfg = load_config(args.config or DEMO_CONFIG, args.overrides)
    # The backend is whatever `accelerate launch` was told: checked, never silently degraded to lone ranks.
    with Run.start(cfg, config_sources(args, "recipes/configs/demo.yaml"), "finetune_llm") as run:
        return train(run, cfg)


def train(run: Run, cfg) -> int:
    accelerator = run.accelerator

    # Data and model: a stop here ends the run at once.
    with run.interruptible():
        tokenizer, train_set, eval_set = run.chat_data()
        flash_varlen = run.features.attention == "flash_attention_2"
        train_loader, sampler = data.train_loader(
            train_set,
            cfg.data,
            cfg.train,
            tokenizer.pad_token_id,
            cfg.seed,
            flash_varlen,
            collate=run.collate(tokenizer.pad_token_id),
        )
        eval_loader = run.eval_loader(eval_set, tokenizer.pad_token_id)
        model = run.load_model()
        # pipeline.size > 1: this process keeps its stages' layers only, and a schedule runs each step.
        pipeline = run.pipeline(model, tokenizer.pad_token_id, loss.summed_logps_loss)
    optimizer, scheduler = run.optimizer(model)
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    evaluator = evaluate.Evaluator(
        accelerator, model, tokenizer, eval_loader, eval_set, cfg.eval, run.log, pipeline, run.images
    )
    start_step = run.begin(model, evaluator)  # a checkpoint's state, or the starting point measured

    # The loop: one iteration per optimizer step, `grad_accum` micro-batches each, the loss summed over
    # the step's target tokens on every rank.
    model.train()
    for step, micro_batches in run.steps(train_loader, sampler, start_step):
        step_targets, step_tokens, step_rows = run.global_counts(
            [
                sum(loss.batch_targets(b) for b in micro_batches),
                sum(data.count_tokens(b) for b in micro_batches),
                sum(data.count_rows(b) for b in micro_batches),
            ]
        )
        scale = loss.backward_scale(step_targets, run.grad_accum, run.gradient_ranks)
        if pipeline is not None:
            loss_sum = pipeline.step(micro_batches, scale)
        else:
            loss_sum = torch.zeros((), device=accelerator.device)
            for batch in micro_batches:
                with accelerator.accumulate(model), run.micro_batch() as router:
                    micro_loss = loss.batch_loss(model, batch)
                    accelerator.backward(micro_loss * scale + router.loss(data.real_tokens(batch)))
                    loss_sum += micro_loss.detach()
        step_loss = run.global_sum(loss_sum).item() / max(step_targets, 1)
        grad_norm = run.update(model, optimizer, scheduler, step, step_loss)
        run.log_step(step, scheduler, step_tokens, step_rows, loss=step_loss, grad_norm=grad_norm)
        eval_result = evaluator.evaluate(step) if run.evaluating(step) else {}
        run.maybe_checkpoint(step, eval_result)
        if run.should_stop():
            return run.stopped(step)

    # Finish: final checkpoint, the measured result, the exported model.
    return run.finish(model, tokenizer, evaluator)


if __name__ == "__main__":
    exit_with(main, "finetune_llm")
