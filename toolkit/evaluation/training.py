"""`eval.benchmarks`: lm-eval tasks scored while a recipe trains (toolkit/train/evaluate.py runs them at
each evaluation; the launch check below keeps them to launches where the main process holds the whole
model)."""

from __future__ import annotations

from toolkit.errors import UserError
from toolkit.evaluation import harness, tasks


def check_benchmarks(cfg, backend: str, uses_mesh: bool, recipe_source: str) -> None:
    """Refuse, in one line, `eval.benchmarks` on a launch whose main process does not hold the whole model
    (all but one process or DDP without a model-parallel mesh), in the preference recipe, or naming an
    unknown task, before anything loads."""
    if not cfg.eval.benchmarks:
        return
    if backend not in ("single", "ddp") or uses_mesh:
        layout = f"{backend} with a model-parallel mesh" if uses_mesh else backend
        raise UserError(
            f"{recipe_source.of('eval.benchmarks')}: eval.benchmarks scores the whole model on the main "
            f"process: launch it on one process or DDP, not {layout} (or run ftkit eval on the result)"
        )
    if hasattr(cfg, "dpo"):
        raise UserError(
            f"{recipe_source.of('eval.benchmarks')}: eval.benchmarks: the SFT and GRPO recipes score "
            "benchmarks during training; score a preference-tuned model with ftkit eval"
        )
    try:
        tasks.resolve(cfg.eval.benchmarks, None)
    except UserError as exc:
        raise UserError(
            f"{recipe_source.of('eval.benchmarks')}: eval.benchmarks: {str(exc).removeprefix('--tasks: ')}"
        ) from None


def scores_now(
    model, tokenizer, names: list[str], limit: int | None, batch_size: int = 8
) -> dict[str, float]:
    """Each task's metrics as bench/<task>/<metric> (their standard errors left out: the curve is the
    point)."""
    manager, specs = tasks.resolve(names, None)
    results = harness.evaluate(model, tokenizer, specs, manager, limit, batch_size)
    return {f"bench/{s.task}/{s.metric}": s.value for s in harness.scores(results)}
