"""One loaded model scored on lm-eval tasks: lm-eval's HF model class wraps the model ftkit loaded (the
same loading as `ftkit generate`: adapter over its base, or a whole model), so every task of a call reuses
it, and lm-eval's own evaluator does the rest."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from toolkit.errors import UserError

# The exceptions a task's dataset raises where it must come from the hub and cannot (by class name, so no
# hub library is imported for them): no network, offline mode, or not in the local cache.
HUB_FAILURES = {
    "ConnectionError",
    "DatasetNotFoundError",
    "OfflineModeIsEnabled",
    "LocalEntryNotFoundError",
    "HfHubHTTPError",
    "FileNotFoundError",
}


# What lm-eval's HF model logs whenever it is handed a loaded model, launched or not: that model arguments
# may be ignored (ftkit passes none) and that distribution is the caller's (set in `evaluate`).
HANDED_OVER_NOTES = ("`pretrained` model kwarg is not of type `str`", "Passed an already-initialized model")


def _not_a_handed_over_note(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(HANDED_OVER_NOTES)


@dataclass(frozen=True)
class Score:
    """One metric of one task: its value, its standard error (None where lm-eval gives none) and the
    number of examples scored."""

    task: str
    metric: str
    value: float
    stderr: float | None
    higher_is_better: bool
    samples: int


def check_data(specs: list, manager) -> None:
    """Build each task once, so a task whose data cannot be had is named in one line before any model
    runs (datasets caches what it loaded: the evaluation reads it again from there)."""
    from lm_eval.tasks import get_task_dict

    for spec in specs:
        name = spec["task"] if isinstance(spec, dict) else spec
        try:
            get_task_dict([spec], manager)
        except Exception as exc:
            if not any(kind.__name__ in HUB_FAILURES for kind in type(exc).__mro__):
                raise
            raise UserError(
                f"--tasks: {name} needs data this machine does not have ({str(exc).splitlines()[0][:160]}); "
                "fetch it where the hub is reachable (docs/eval.md: offline tasks) or use a local task"
            ) from None


def evaluate(
    model,
    tokenizer,
    specs: list,
    manager,
    limit: int | None,
    batch_size: int,
    samples: bool = False,
    accelerator=None,
) -> dict | None:
    """lm-eval's results for `model` on the tasks (`tasks.resolve`'s specs): the chat template is applied
    where the tokenizer has one, generation is greedy, seeds are lm-eval's defaults; `samples`: with each
    example's inputs and outputs. Under a launch of several processes (`accelerator`), each scores its
    share of every task's examples and the main process gets them all (`processes`: how many shared
    them); the others get None."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    logging.getLogger("lm_eval.models.huggingface").addFilter(_not_a_handed_over_note)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    if accelerator is not None and accelerator.num_processes > 1:
        # lm-eval splits requests by rank and gathers them on rank 0, but sets the ranks up only for a
        # model it loads itself: a model handed over is told the launch here.
        lm.accelerator = accelerator
        lm._rank, lm._world_size = accelerator.process_index, accelerator.num_processes
    results = simple_evaluate(
        model=lm,
        tasks=specs,
        limit=limit,
        task_manager=manager,
        apply_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        log_samples=samples,
        bootstrap_iters=1000,
        verbosity="ERROR",
    )
    if results is not None:
        results["processes"] = lm.world_size  # the processes lm-eval split the examples over
    return results


def scores(results: dict) -> list[Score]:
    """Every metric lm-eval reports for each task (and each group), in its order, with its stderr."""
    found = []
    for task, values in results["results"].items():
        higher = results.get("higher_is_better", {}).get(task, {})
        samples = results.get("n-samples", {}).get(task, {}).get("effective", 0)
        for key, value in values.items():
            metric, comma, filter_name = key.partition(",")
            if not comma or metric.endswith("_stderr") or not isinstance(value, int | float):
                continue
            stderr = values.get(f"{metric}_stderr,{filter_name}")
            stderr = float(stderr) if isinstance(stderr, int | float) else None
            found.append(Score(task, metric, float(value), stderr, higher.get(metric, True), samples))
    return found
