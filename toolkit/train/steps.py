"""The pieces of a step and of a run's end that toolkit/run.py puts together: the update (clipping, the
non-finite guard, optimizer and scheduler), the logging cadence and the export. The loss is each recipe's."""

from __future__ import annotations

import shlex
from pathlib import Path

from toolkit import distributed
from toolkit.checkpoint import export
from toolkit.model import scalar
from toolkit.train.nonfinite import NonFiniteGuard


def apply_update(
    accelerator,
    model,
    optimizer,
    scheduler,
    guard: NonFiniteGuard,
    step: int,
    loss: float,
    max_norm: float,
    clip=None,
) -> float:
    """Clip (returning the norm before clipping), then step optimizer and scheduler unless the guard
    drops this step; gradients are cleared either way. `clip(max_norm)`: the clipping of a model split
    in a way the backend does not know (a pipeline), else the backend's."""
    norm = clip(max_norm) if clip else distributed.clip_grad_norm(accelerator, model, max_norm)
    grad_norm = float(norm)
    if guard.allows_update(step, loss, grad_norm):
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad()
    return grad_norm


def every(step: int, period: int, last_step: int = 0) -> bool:
    """True every `period` steps (never for 0) and at `last_step`."""
    return bool(period) and step % period == 0 or step == last_step


def export_final(accelerator, model, tokenizer, cfg, output_dir: Path) -> Path:
    """Collective: the trained model as Hugging Face files in output_dir/final (and final/merged on
    request for adapters)."""
    final_dir = output_dir / "final"
    export.export_model(accelerator, model, tokenizer, final_dir, cfg.export.dtype)
    if cfg.model.adapter and cfg.model.method != "full" and accelerator.is_main_process:
        export.keep_start_adapter(final_dir, cfg.model.adapter)
    if cfg.export.merge and cfg.model.method != "full" and accelerator.is_main_process:
        qlora = cfg.model.method == "qlora"
        export.merge_adapter(final_dir, final_dir / "merged", cfg.export.dtype, dequantized=qlora)
    accelerator.wait_for_everyone()
    return final_dir


def closing_lines(
    shown: dict[str, dict], final_dir: Path, prompt: str | None, image: str | None = None
) -> list[str]:
    """The three lines every run ends with: the task metric before and after training (exact match or a
    reward model's pairwise accuracy where measured, else the eval loss), where the result went, and the
    command that tries it (on `image`, for a vision-language model)."""
    after, before = shown.get("after", {}), shown.get("before", {})
    reward_model = scalar.saved_scalar(final_dir)
    keys = ("eval_reward_accuracy",) if reward_model else ("exact_match", "eval_loss")
    key = next((k for k in keys if k in after), None)
    if key is None:
        result = "result: no held-out evaluation (data.eval)"
    else:
        fmt = "{:.4g}" if key == "eval_loss" else "{:.1%}"
        start = f"{fmt.format(before[key])} -> " if key in before else "(resumed) "
        name = "pairwise accuracy" if key == "eval_reward_accuracy" else key.replace("_", " ")
        result = f"result: held-out {name} {start}{fmt.format(after[key])}"
    command = f"ftkit generate --model {final_dir} --prompt {shlex.quote(prompt or '...')}"
    if reward_model:
        command = command.replace("generate", "score", 1) + " --answer ..."
    if image:
        command += f" --image {shlex.quote(image)}"
    return [result, f"saved: {final_dir.resolve()}", f"try: {command}"]


def first_image(dataset) -> str | None:
    """The first image among the opening held-out rows (what the closing line's command asks about)."""
    rows = (dataset[i] for i in range(min(len(dataset), 100))) if dataset is not None else ()
    return next((row["images"][0] for row in rows if row.get("images")), None)
