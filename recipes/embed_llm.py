"""Embedding models: a decoder or encoder's pooled hidden states trained with InfoNCE over in-batch and hard
negatives (gathered from every process with their gradients), full, LoRA or QLoRA, on any backend.

    accelerate launch [--config_file accelerate_configs/<backend>.yaml] recipes/embed_llm.py \\
        [--config recipes/configs/<run>.yaml] [dotted.key=value ...]

With no arguments it teaches the embedded tiny model to find, for a question, the passage that answers it
(recipes/configs/demo-embed.yaml). Set-up, resume, step machinery and checkpoints are every recipe's; the
data layouts, pooling, loss, retrieval metrics and the sentence-transformers export are toolkit/embed/'s.
"""

from __future__ import annotations

import functools

import torch

from toolkit import data
from toolkit.embed import config as embed_config
from toolkit.embed import data as embed_data
from toolkit.embed import evaluate, export, pooling
from toolkit.embed import loss as embed_loss
from toolkit.entry import exit_with, recipe_args
from toolkit.errors import UserError
from toolkit.run import Run
from toolkit.train import loss


def main(argv: list[str]) -> int:
    args = recipe_args(argv, __doc__, "recipes/configs/demo-embed.yaml", "embed.temperature=0.02")
    cfg = embed_config.load_embed_config(args.config, args.overrides)
    mode = pooling.model_pooling(cfg.model, cfg.embed.pooling)  # a model it cannot pool stops here
    with Run.start(cfg, args.config or str(embed_config.DEMO_EMBED_CONFIG), "embed_llm") as run:
        return train(run, cfg, mode)


def train(run: Run, cfg, mode: str) -> int:
    accelerator, embed = run.accelerator, cfg.embed
    if run.launch.mesh.data_parallel != run.launch.world_size:
        raise UserError("embeddings train data-parallel only (ddp, fsdp, zero); launch without tp, sp or ep")

    # Texts and model: a stop here ends the run at once.
    with run.interruptible():
        tokenizer = run.chat_tokenizer()
        if run.images is not None:
            raise UserError(f"model.path: {cfg.model.path} is a vision-language model; embeddings are text")
        tokenizer.padding_side = "right"
        sets = embed_data.build_embed_data(
            cfg.data, tokenizer, embed.query_prefix, cfg.seed, accelerator.main_process_first
        )
        accelerator.print(sets.summary())
        collate = embed_data.TripletCollator(tokenizer.pad_token_id)
        loader, sampler = data.train_loader(
            sets.train, cfg.data, cfg.train, tokenizer.pad_token_id, cfg.seed, False, collate
        )
        model = run.load_model(bare=True)
    optimizer, scheduler = run.optimizer(model)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    evaluator = evaluate.RetrievalEvaluator(accelerator, model, tokenizer, sets.eval, cfg, mode, run.log)
    start_step = run.begin(model, evaluator)  # a checkpoint's state, or the starting point measured
    # Every query's negatives are the whole global batch's passages: a step of several micro-batches per
    # process is embedded first without gradients, then each micro-batch again with the loss's gradient.
    cached = embed.cached or run.grad_accum > 1
    losses = (sets.negatives, embed.temperature, embed.matryoshka_dims)

    # The loop: one iteration per optimizer step; the loss is the mean over every query of the step.
    model.train()
    for step, micro_batches in run.steps(loader, sampler, start_step, desc="embed"):
        queries, step_tokens = run.global_counts(
            [
                sum(embed_data.batch_rows(b, sets.negatives) for b in micro_batches),
                sum(int(b["attention_mask"].sum()) for b in micro_batches),
            ]
        )
        scale = loss.backward_scale(queries, run.grad_accum, run.gradient_ranks)
        if cached:
            with torch.no_grad():
                vectors = [pooling.embed(model, b, mode, normalize=False) for b in micro_batches]
            terms, grads = embed_loss.cached_gradients(vectors, *losses)
            for batch, grad in zip(micro_batches, grads, strict=True):
                with accelerator.accumulate(model), run.micro_batch():
                    vectors = pooling.embed(model, batch, mode, normalize=False)
                    accelerator.backward(embed_loss.surrogate(vectors, grad) * scale)
        else:
            with accelerator.accumulate(model), run.micro_batch():
                vectors = pooling.embed(model, micro_batches[0], mode, normalize=False)
                terms = embed_loss.step_terms(vectors, *losses)
                accelerator.backward(terms.loss_sum * scale)
        sums = run.global_sum(torch.tensor([terms.loss_sum.item(), terms.correct], device=accelerator.device))
        step_loss, accuracy = (sums / queries).tolist()
        grad_norm = run.update(model, optimizer, scheduler, step, step_loss)
        per_second = {"queries": queries}
        run.log_step(
            step,
            scheduler,
            step_tokens,
            queries,
            per_second,
            loss=step_loss,
            in_batch_accuracy=accuracy,
            grad_norm=grad_norm,
        )
        eval_result = evaluator.evaluate(step) if run.evaluating(step) else {}
        run.maybe_checkpoint(step, eval_result)
        if run.should_stop():
            return run.stopped(step)

    # Finish: final checkpoint, held-out retrieval after training, the sentence-transformers folder.
    write = functools.partial(export.export_embedder, pooling=mode)
    return run.finish(model, tokenizer, evaluator, export=write, closing=evaluator.closing)


if __name__ == "__main__":
    exit_with(main, "embed_llm")
