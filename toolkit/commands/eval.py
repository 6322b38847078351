"""`ftkit eval`: a fine-tuned model and its base scored on benchmarks through lm-evaluation-harness, side
by side; the table and lm-eval's raw results written into the run folder's eval/."""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

import yaml

from toolkit.checkpoint.export import ADAPTER_CONFIG
from toolkit.checkpoint.rundir import CONFIG, EVAL_DIR, record_eval
from toolkit.errors import UserError
from toolkit.evaluation import compare, harness, tasks
from toolkit.model.for_generation import check_model_dir, load_for_generation


def eval_cli(
    model_dir: str,
    task_list: str,
    base: str | None = None,
    include: str | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    as_json: bool = False,
    trust_remote_code: bool = False,
) -> str:
    """The before/after table (Markdown, or JSON with `as_json`); `base` None: the run's own base model,
    "none": the fine-tuned model alone."""
    path = Path(model_dir)
    manager, specs = checked_tasks(task_list, include, limit, batch_size)
    base_path = base_model_of(path) if base is None else (None if base == "none" else base)
    accelerator = launched()
    settings = (specs, manager, limit, batch_size, trust_remote_code, accelerator)
    raw = {"fine-tuned": _evaluate(path, *settings)}
    if base_path:
        raw["base"] = _evaluate(Path(base_path), *settings)
    if raw["fine-tuned"] is None:  # a launch's other process: its share is with the main one
        return ""
    table = compare.rows(harness.scores(raw["fine-tuned"]), raw.get("base") and harness.scores(raw["base"]))
    text = compare.markdown(table, str(path), base_path)
    processes = raw["fine-tuned"]["processes"]
    shown = {"model": str(path), "base": base_path, "processes": processes, "rows": compare.as_json(table)}
    written = _write(run_folder(path), text, shown, raw)
    if as_json:
        return json.dumps(shown | {"written": written}, indent=2)
    return text + (f"\nwritten: {written}" if written else "")


def base_model_of(path: Path) -> str | None:
    """The model a run started from: an adapter's base, or the `model.path` of the run's saved config."""
    if (path / ADAPTER_CONFIG).is_file():
        return json.loads((path / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    folder = run_folder(path)
    if folder is None:
        return None
    config = yaml.safe_load((folder / CONFIG).read_text()) or {}
    return (config.get("model") or {}).get("path")


def run_folder(path: Path) -> Path | None:
    """The ftkit run a model directory belongs to (final/, final/merged/ or a checkpoint), or None."""
    for folder in (path.parent, path.parent.parent):
        if (folder / CONFIG).is_file():
            return folder
    return None


def checked_tasks(task_list: str, include: str | None, limit: int | None, batch_size: int):
    """(task manager, task specs) once the options hold and every task's data is at hand."""
    names = [name.strip() for name in task_list.split(",") if name.strip()]
    if not names:
        raise UserError("--tasks: name at least one task (comma-separated)")
    if limit is not None and limit < 1:
        raise UserError(f"--limit: {limit} is not a positive number of examples")
    if batch_size < 1:
        raise UserError(f"--batch-size: {batch_size} is not a positive number of examples")
    manager, specs = tasks.resolve(names, include)
    harness.check_data(specs, manager)
    return manager, specs


def launch_processes(args) -> int:
    """`ftkit eval ... --gpus N`: the same command on N data-parallel processes (`accelerate launch`);
    each scores its share of the examples, the main process prints and writes the table. The options and
    the model directory are checked first, so a mistake costs no launch."""
    from toolkit.commands import relay

    check_model_dir(Path(args.model))
    checked_tasks(args.tasks, args.include, args.limit, args.batch_size)
    launch = ["accelerate", "launch", "--multi_gpu", "--num_processes", str(args.gpus), "--num_machines", "1"]
    launch += ["--mixed_precision", "no", "--dynamo_backend", "no", *args.accelerate_args]
    # Each process runs the command as typed, its last --gpus 1 keeping it from launching again.
    command = ["-m", "toolkit.commands.cli", *args.argv, "--gpus", "1"]
    return relay.run([*launch, *command], os.environ, "ftkit eval")


def launched():
    """The Accelerator of a launch of several processes (gloo CPU processes without a GPU), else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch
    from accelerate import Accelerator

    return Accelerator(cpu=not torch.cuda.is_available())


def _one_device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _evaluate(path: Path, specs, manager, limit, batch_size, trust_remote_code, accelerator) -> dict | None:
    """lm-eval's results for the model at `path`, scored on this process's device (its GPU under a
    launch, the first GPU otherwise, else the CPU); None on a launch's other processes."""
    model, tokenizer = load_for_generation(path, trust_remote_code)
    try:
        model.to(accelerator.device if accelerator else _one_device())
        return harness.evaluate(model, tokenizer, specs, manager, limit, batch_size, False, accelerator)
    finally:
        del model
        gc.collect()


def _write(folder: Path | None, text: str, shown: dict, raw: dict) -> str | None:
    """eval/<UTC time>.md and .json in the run folder (new names: nothing there is overwritten), recorded
    in the run's marker as ftkit's."""
    if folder is None:
        return None
    out = folder / EVAL_DIR
    out.mkdir(exist_ok=True)
    stem = out / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    (stem.with_suffix(".md")).write_text(text)
    raw = {name: {k: r[k] for k in ("results", "n-samples", "configs") if k in r} for name, r in raw.items()}
    (stem.with_suffix(".json")).write_text(json.dumps(shown | {"lm_eval": raw}, indent=2, default=str))
    record_eval(folder, [stem.with_suffix(".md").name, stem.with_suffix(".json").name])
    return str(stem.with_suffix(".md"))
