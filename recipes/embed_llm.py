"""Embedding models and rerankers: a decoder's pooled hidden states trained with InfoNCE over in-batch and
hard negatives (gathered from every process with their gradients), or a cross-encoder's score of a query and
a passage (listwise or pointwise); full, LoRA or QLoRA, on any data-parallel backend.

    accelerate launch [--config_file accelerate_configs/<backend>.yaml] recipes/embed_llm.py \\
        [--config recipes/configs/<run>.yaml] [dotted.key=value ...]

With no arguments it teaches the embedded tiny model to find, for a question, the passage that answers it
(recipes/configs/demo-embed.yaml). Set-up, resume, step machinery and checkpoints are every recipe's; the
data layouts, pooling, losses, retrieval metrics and the sentence-transformers export are toolkit/embed/'s.
"""

from __future__ import annotations

import functools

import torch

from toolkit import data
from toolkit.embed import classify, evaluate, export, pooling, rerank
from toolkit.embed import config as embed_config
from toolkit.embed import data as embed_data
from toolkit.embed import loss as embed_loss
from toolkit.entry import exit_with, recipe_args
from toolkit.errors import UserError
from toolkit.run import Run
from toolkit.train import loss


def main(argv: list[str]) -> int:
    args = recipe_args(argv, __doc__, "recipes/configs/demo-embed.yaml", "embed.temperature=0.02")
    cfg = embed_config.load_embed_config(args.config, args.overrides)
    # Mistakes found before anything is written: a model it cannot pool, a reranker's file without scores,
    # a classifier's label outside embed.labels.
    mode = None
    if cfg.embed.task == "reranker":
        rerank.check_first_records(cfg.data, cfg.embed.rerank_loss == "listwise")
    elif cfg.embed.task == "classifier":
        classify.check_labels(cfg.data, cfg.embed.labels)
    else:
        mode = pooling.model_pooling(cfg.model, cfg.embed.pooling)
    with Run.start(cfg, args.config or str(embed_config.DEMO_EMBED_CONFIG), "embed_llm") as run:
        if run.launch.mesh.data_parallel != run.launch.world_size:
            raise UserError(
                "embed_llm trains data-parallel only (ddp, fsdp, zero); launch without tp, sp, ep"
            )
        with run.interruptible():
            tokenizer = run.chat_tokenizer()
            if run.images is not None:
                raise UserError(
                    f"model.path: {cfg.model.path} is a vision-language model; embed_llm reads text"
                )
            tokenizer.padding_side = "right"
        if cfg.embed.task == "embedding":
            return train_embeddings(run, cfg, tokenizer, mode)
        return train_head(run, cfg, tokenizer)


def train_embeddings(run: Run, cfg, tokenizer, mode: str) -> int:
    accelerator, embed = run.accelerator, cfg.embed
    with run.interruptible():  # a stop while the data and model load ends the run at once
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
        if not finish_step(
            run, model, optimizer, scheduler, evaluator, step, step_loss, step_tokens, queries, accuracy
        ):
            return run.stopped(step)

    # Finish: final checkpoint, held-out retrieval after training, the sentence-transformers folder.
    write = functools.partial(export.export_embedder, pooling=mode)
    return run.finish(model, tokenizer, evaluator, export=write, closing=evaluator.closing)


def train_head(run: Run, cfg, tokenizer) -> int:
    """A reranker (one score per query-passage pair) or a classifier (one number per label)."""
    accelerator, embed = run.accelerator, cfg.embed
    pad = tokenizer.pad_token_id
    with run.interruptible():  # a stop while the data and model load ends the run at once
        if embed.task == "reranker":
            listwise = embed.rerank_loss == "listwise"
            sets = rerank.build_rerank_data(
                cfg.data, tokenizer, listwise, cfg.seed, accelerator.main_process_first
            )
            collate, labels = rerank.CandidateCollator(pad), 1
            terms = functools.partial(rerank.rerank_terms, listwise=listwise)
        else:
            sets = classify.build_labelled_data(
                cfg.data, tokenizer, embed.labels, cfg.seed, accelerator.main_process_first
            )
            collate, labels, terms = classify.LabelCollator(pad), len(embed.labels), classify.class_terms
        accelerator.print(sets.summary())
        loader, sampler = data.train_loader(sets.train, cfg.data, cfg.train, pad, cfg.seed, False, collate)
        model = run.load_model(scalar_head=True, num_labels=labels)
        model.config.pad_token_id = pad  # the head reads each row's last real token
    optimizer, scheduler = run.optimizer(model)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if embed.task == "reranker":
        evaluator = evaluate.RerankEvaluator(accelerator, model, tokenizer, sets.eval, cfg, run.log)
    else:
        evaluator = evaluate.ClassifierEvaluator(accelerator, model, tokenizer, sets.eval, cfg, run.log)
    start_step = run.begin(model, evaluator)

    # The loop: each row's loss stands alone, so micro-batches accumulate as in every recipe.
    model.train()
    for step, micro_batches in run.steps(loader, sampler, start_step, desc=embed.task):
        rows, step_tokens = run.global_counts(
            [
                sum(row_count(b) for b in micro_batches),
                sum(int(b["attention_mask"].sum()) for b in micro_batches),
            ]
        )
        scale = loss.backward_scale(rows, run.grad_accum, run.gradient_ranks)
        sums = torch.zeros(2, device=accelerator.device)
        for batch in micro_batches:
            with accelerator.accumulate(model), run.micro_batch():
                summed, correct, _ = terms(model, batch)
                accelerator.backward(summed * scale)
            sums += torch.stack([summed.detach(), torch.tensor(float(correct), device=accelerator.device)])
        step_loss, accuracy = (run.global_sum(sums) / rows).tolist()
        if not finish_step(
            run, model, optimizer, scheduler, evaluator, step, step_loss, step_tokens, rows, accuracy
        ):
            return run.stopped(step)

    # Finish: final checkpoint, the held-out evaluation after training, the exported folder.
    write = export.export_reranker if embed.task == "reranker" else export.export_classifier
    return run.finish(model, tokenizer, evaluator, export=write, closing=evaluator.closing)


def row_count(batch: dict) -> int:
    """Queries (a reranker's candidate lists) or texts (a classifier's) in `batch`."""
    return len(batch["scores"]) if "scores" in batch else len(batch["label"])


def finish_step(run: Run, model, optimizer, scheduler, evaluator, step, step_loss, tokens, queries, accuracy):
    """The update, the step's metrics, an evaluation and a checkpoint when due; False when the run stops."""
    grad_norm = run.update(model, optimizer, scheduler, step, step_loss)
    run.log_step(
        step,
        scheduler,
        tokens,
        queries,
        {"queries": queries},
        loss=step_loss,
        top1_accuracy=accuracy,
        grad_norm=grad_norm,
    )
    eval_result = evaluator.evaluate(step) if run.evaluating(step) else {}
    run.maybe_checkpoint(step, eval_result)
    return not run.should_stop()


if __name__ == "__main__":
    exit_with(main, "embed_llm")
