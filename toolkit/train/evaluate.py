"""Held-out evaluation: token-exact loss and perplexity across ranks, greedy answers and exact match."""

from __future__ import annotations

import contextlib
import itertools
import math

import torch
from torch.utils.data import DataLoader

from toolkit.config import EvalConfig
from toolkit.distributed import root_params_gathered, sum_over_data, unwrap
from toolkit.evaluation import training
from toolkit.model.speed import eager_blocks
from toolkit.pipeline.generate import PipelineGenerator
from toolkit.train.generation import chat_prompt_ids, exact_match, greedy_answer, split_prompt
from toolkit.train.loss import batch_loss, count_targets
from toolkit.train.metrics import MetricsLog


class Evaluator:
    """Everything a run's evaluations need, gathered once after `accelerator.prepare`.

    `loader` and `dataset` are the held-out rows (each None when the run has none): the loader is this
    rank's share for the loss, the dataset the rows whose answers are generated. With a `pipeline` both
    run through its stages.
    """

    def __init__(
        self,
        accelerator,
        model,
        tokenizer,
        loader: DataLoader | None,
        dataset,
        cfg: EvalConfig,
        log: MetricsLog,
        pipeline=None,
        images=None,
        conversations=None,
    ):
        self.accelerator, self.model, self.tokenizer = accelerator, model, tokenizer
        self.loader, self.dataset, self.cfg, self.log = loader, dataset, cfg, log
        self.pipeline = pipeline
        self.images = images
        """A vision-language model's data.ImageInputs (rows' images to pixels), else None."""
        self.conversations = conversations
        """A GRPO run with an environment: its held-out conversations (grpo/held_out.py's ConversationEval),
        whose `measure(model)` scores whole conversations in place of the first turn; else None."""
        self.shown: dict[str, dict] = {}
        """What each `report` measured, by its label ("before", "after"): the run's closing lines read it."""

    def evaluate(self, step: int) -> dict:
        """Collective: eval loss and perplexity and the benchmarks' scores, logged at `step`; {} when the
        run holds no eval rows and scores no benchmark."""
        results = self._loss() if self.loader is not None else {}
        results |= self._benchmarks()
        return self.log.write(step, **results) if results else {}

    def report(self, step: int, label: str) -> None:
        """Collective: eval loss, exact match and one sample answer, shown (tagged `label`) and logged."""
        with eval_mode(self.model):
            self._report(step, label)

    def _report(self, step: int, label: str) -> None:
        results = self._loss() if self.loader is not None else {}
        results |= self._benchmarks()
        cfg, synced = self.cfg, self.accelerator.num_processes > 1
        generator = unwrap(self.accelerator, self.model)
        if self.pipeline is not None:
            generator = PipelineGenerator(self.pipeline)
        if self.conversations is not None:
            results |= self.conversations.measure(self.model)
        elif self.dataset is not None and cfg.exact_match_samples:
            # FSDP1 casts its inner units to bf16 but not the gathered root: autocast joins the two.
            with root_params_gathered(self.model), self.accelerator.autocast():
                results["exact_match"] = exact_match(
                    generator,
                    self.tokenizer,
                    self.dataset,
                    cfg.exact_match_samples,
                    cfg.max_new_tokens,
                    synced,
                    self.images,
                )
        self._show(step, label, results)
        prompt_ids, pixels = self._sample_prompt()
        if prompt_ids is not None:
            with root_params_gathered(self.model), self.accelerator.autocast():
                answer = greedy_answer(
                    generator, self.tokenizer, prompt_ids, cfg.max_new_tokens, synced, pixels
                )
            question = " ".join(self.tokenizer.decode(prompt_ids, skip_special_tokens=True).split())
            self.accelerator.print(f"[{label}] sample: {question!r} -> {answer!r}")

    def _show(self, step: int, label: str, results: dict) -> None:
        self.shown[label] = results
        if results:
            self.log.write(step, **results)
            self.accelerator.print(f"[{label}] " + "  ".join(f"{k}={v:.4g}" for k, v in results.items()))

    def _benchmarks(self) -> dict:
        """Collective: `eval.benchmarks` scored by lm-eval on the main process's whole model (the launch
        check keeps them to one process or DDP), while the other ranks wait."""
        if not self.cfg.benchmarks:
            return {}
        scores = {}
        if self.accelerator.is_main_process:
            model = unwrap(self.accelerator, self.model)
            with eval_mode(self.model), eager_blocks(), self.accelerator.autocast():
                scores = training.scores_now(
                    model, self.tokenizer, self.cfg.benchmarks, self.cfg.benchmark_limit
                )
        self.accelerator.wait_for_everyone()
        return scores

    def _loss(self) -> dict:
        if self.pipeline is not None:
            return pipeline_eval_loss(self.pipeline, self.loader, self.accelerator, self.cfg.max_batches)
        return eval_loss(self.model, self.loader, self.accelerator, self.cfg.max_batches)

    def _sample_prompt(self) -> tuple[list[int] | None, dict | None]:
        """(prompt ids, image inputs or None): the configured prompt, else the first eval row's prompt
        (with its images), else none."""
        if self.cfg.sample_prompt:
            return chat_prompt_ids(self.tokenizer, self.cfg.sample_prompt), None
        row = self.dataset[0] if self.dataset is not None else None
        pair = split_prompt(row) if row is not None else None
        if pair is None:
            return None, None
        refs = row.get("images")
        pixels = self.images.prompt_inputs(pair[0], refs, "an eval row") if self.images and refs else None
        return pair[0], pixels


def pipeline_eval_loss(pipeline, loader: DataLoader, accelerator, max_batches: int = 0) -> dict:
    """Collective: `eval_loss` through a pipeline's stages, its micro-batches a schedule step at a time."""
    batches = list(itertools.islice(loader, max_batches or None))
    loss_sum, tokens = 0.0, 0
    for start in range(0, len(batches), pipeline.grad_accum):
        group = batches[start : start + pipeline.grad_accum]
        loss_sum += pipeline.eval_sum(group).item()
        tokens += sum(count_targets(batch["labels"]) for batch in group)
    return _loss_result(accelerator, torch.tensor([loss_sum, float(tokens)], dtype=torch.float64))


@contextlib.contextmanager
def eval_mode(model):
    """`model` in eval mode for the duration, in training mode after. Generation too needs it: sequence
    parallel attention splits rows in training mode only."""
    model.eval()
    try:
        yield
    finally:
        model.train()


@torch.no_grad()
def eval_loss(model, loader: DataLoader, accelerator, max_batches: int = 0) -> dict:
    """Collective: mean token loss over the whole eval set (all ranks) and its perplexity. Compiled blocks
    run eagerly here (`eager_blocks`): an eval-mode graph would be one more compilation before the first
    step, and costs more than it saves over the default before/after evaluations (docs/recipes.md)."""
    was_training = getattr(model, "module", model).training  # DeepSpeed's engine keeps a stale flag
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    with eager_blocks():
        for batch in itertools.islice(loader, max_batches or None):
            batch = {key: value.to(accelerator.device) for key, value in batch.items()}
            count = torch.tensor(
                float(count_targets(batch["labels"])), dtype=torch.float64, device=totals.device
            )
            totals += torch.stack([batch_loss(model, batch).double(), count])
    model.train(was_training)
    return _loss_result(accelerator, totals)


def _loss_result(accelerator, totals: torch.Tensor) -> dict:
    """Collective: the eval loss and perplexity from this rank's (summed loss, target tokens)."""
    loss_sum, tokens = sum_over_data(accelerator, totals.to(accelerator.device)).tolist()
    loss = loss_sum / max(tokens, 1)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50)), "eval_tokens": int(tokens)}
