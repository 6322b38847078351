"""The New run form turned into `ftkit train`'s command line, checked by the functions `ftkit train`,
`ftkit plan` and `ftkit check-config` call, then launched detached; and Stop, Resume and Delete."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from toolkit.errors import UserError
from toolkit.studio import runs
from toolkit.studio.guard import Roots, inside, run_folder

RECIPES = {"sft": "sft", "dpo": "dpo", "kto": "dpo", "rm": "rm", "grpo": "grpo"}
"""The form's recipes and the `ftkit train` recipe each one runs (KTO is the preference recipe's loss)."""
METHODS = ("full", "lora", "dora", "qlora")
KNOBS = {
    "max_steps": "train.max_steps",
    "learning_rate": "train.learning_rate",
    "global_batch_size": "train.global_batch_size",
    "micro_batch_size": "train.micro_batch_size",
    "max_length": "data.max_length",
    "lora_r": "lora.r",
    "save_every_steps": "train.save_every_steps",
    "log_every_steps": "train.log_every_steps",
    "exact_match_samples": "eval.exact_match_samples",
}
"""The main knobs: form field -> config key (left empty: the recipe's demo config's value)."""
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
TOOLKIT_ROOT = Path(__file__).resolve().parents[2]
FTKIT = [sys.executable, "-m", "toolkit.commands.cli"]
"""`ftkit` itself: the module its console script runs, with the studio's Python and tree."""


@dataclass
class NewRun:
    """The New run form as submitted (every value a string, as typed)."""

    name: str = ""
    recipe: str = "sft"
    model: str = ""
    data: str = ""
    method: str = "lora"
    backend: str = "auto"
    max_steps: str = ""
    learning_rate: str = ""
    global_batch_size: str = ""
    micro_batch_size: str = ""
    max_length: str = ""
    lora_r: str = ""
    save_every_steps: str = ""
    log_every_steps: str = ""
    exact_match_samples: str = ""

    @classmethod
    def from_form(cls, form) -> NewRun:
        return cls(**{f.name: str(form.get(f.name, f.default) or "").strip() for f in fields(cls)})


@dataclass
class Preview:
    """What the page shows before anything starts."""

    errors: dict[str, str] = field(default_factory=dict)
    """Form field (or "form") -> the CLI's one-line message."""
    argv: list[str] = field(default_factory=list)
    command: str = ""
    yaml: str = ""
    plan: str = ""
    check: list[str] = field(default_factory=list)
    backend: str = ""


def field_of(message: str, form: NewRun) -> str:
    """The form field a one-line message is about, by the key or path it opens with."""
    prefixes = {
        "name": ("name:", "output_dir:"),
        "recipe": ("recipe ",),
        "method": ("model.method:", "lora.use_dora:"),
        "model": ("model.path:", "model.", "--model"),
        "backend": ("--backend",),
        **{name: (f"{key}:",) for name, key in KNOBS.items()},
        "data": ("data.train:", "data."),
    }
    for name, starts in prefixes.items():
        if message.startswith(starts):
            return name
    for name, key in {"method": "model.method", **KNOBS, "model": "model.path", "data": "data."}.items():
        if re.search(rf"(^|\s){re.escape(key)}\b", message):
            return name
    if form.data and form.data in message:
        return "data"
    return "form"


def overrides_of(form: NewRun, roots: Roots, run_dir: Path) -> list[str]:
    """The key=value items of the command line; every path checked against the roots first."""
    items = [f"output_dir={run_dir}"]
    if form.model:
        items.append(f"model.path={_path_or_hub_id(form.model, roots, 'model.path')}")
    if form.data:
        items.append(f"data.train={_path_or_hub_id(form.data, roots, 'data.train')}")
    if form.method not in METHODS:
        raise UserError(f"model.method: {form.method!r} is not one of {', '.join(METHODS)}")
    items.append(f"model.method={'lora' if form.method == 'dora' else form.method}")
    if form.method == "dora":
        items.append("lora.use_dora=true")
    if form.recipe == "kto":  # the preference demo's chosen-answer NLL has no place in KTO's rows
        items += ["dpo.loss=kto", "dpo.sft_weight=null"]
    items += [f"{key}={getattr(form, name)}" for name, key in KNOBS.items() if getattr(form, name)]
    return items


def _path_or_hub_id(text: str, roots: Roots, key: str) -> str:
    """A local path (checked to lie under the roots) or a hub id (owner/name that is no local path)."""
    local = Path(text).expanduser()
    if HUB_ID.match(text) and not (roots.data / local).exists() and ".." not in local.parts:
        return text
    return str(inside(text, roots, key))


def command_of(recipe: str, backend: str, overrides: list[str]) -> list[str]:
    """`ftkit train` as this Python runs it (the console script's own module)."""
    return [*FTKIT, "train", recipe, "--backend", backend, *overrides]


def shown_command(argv: list[str]) -> str:
    return shlex.join(["ftkit", *argv[3:]])


def preview(form: NewRun, roots: Roots) -> Preview:
    """Everything `ftkit train` checks before it launches, plus the plan table; nothing is written."""
    shown = Preview()
    try:
        _fill(shown, form, roots)
    except UserError as exc:
        shown.errors[field_of(str(exc), form)] = str(exc)
    return shown


def _fill(shown: Preview, form: NewRun, roots: Roots) -> None:
    from toolkit.commands import train
    from toolkit.commands.doctor import probe, report
    from toolkit.launch.machine import probe_machine
    from toolkit.recipes import check_recipe_name, load_recipe_config
    from toolkit.typed_yaml import to_dict

    if form.recipe not in RECIPES:
        raise UserError(f"recipe {form.recipe}: not one of {', '.join(RECIPES)}")
    recipe = check_recipe_name(RECIPES[form.recipe])
    run_dir = run_folder(form.name, roots)
    if run_dir.exists() or runs.record_dir(roots.runs, form.name).exists():
        raise UserError(f"name: {run_dir} exists; choose a new name (a stopped run is resumed from its page)")
    overrides = overrides_of(form, roots, run_dir)
    cfg = load_recipe_config(recipe, None, overrides)
    if cfg.model.trust_remote_code:
        raise UserError("model.trust_remote_code: the studio never runs code shipped with a model")
    machine = probe_machine()
    args = argparse.Namespace(gpus=None, backend=form.backend or "auto", accelerate_args=[], config=None)
    plan = train.plan_launch(args, overrides, cfg, machine, train.Nodes(), train.recipe_path(recipe))
    cfg = load_recipe_config(recipe, None, plan.overrides)
    findings = report.diagnose(probe.gather_probes(roots.runs, include_warnings=False))
    train.preflight(plan, cfg, "the form", findings, machine, os.environ)
    shown.check = [plan.reason] if plan.reason else []
    shown.check += [f"{plan.backend}: {plan.processes} process(es)", data_check(cfg, form.recipe)]
    shown.argv = command_of(recipe, plan.backend, overrides)
    shown.command, shown.backend = shown_command(shown.argv), plan.backend
    shown.yaml = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    shown.plan = plan_table(cfg, recipe, machine)


def data_check(cfg, recipe: str) -> str:
    """`ftkit check-config`'s line on the data, read by the recipe's own reader."""
    from toolkit.commands.check_config import check_chat_rows, check_pairs

    if recipe in ("dpo", "kto", "rm"):
        return check_pairs(cfg, rows_of_one=recipe == "kto")
    return check_chat_rows(cfg)


def plan_table(cfg, recipe: str, machine) -> str:
    """`ftkit plan --config`'s report for this config on this machine's GPUs (one 24 GiB GPU where there is
    none)."""
    from toolkit.plan import estimate, from_config, report

    where = "" if machine.gpu_count else "no GPU here: the plan for one 24 GiB GPU\n\n"
    try:
        options = from_config.options_of(cfg, recipe)
        if machine.gpu_count:
            options.update(gpus=machine.gpu_count, gpu_mem=machine.gpu_mem_gib)
        request, cost = estimate.requests_from_options(options)
        return where + report.render_text(estimate.make_plan(request, cost))
    except UserError as exc:
        return f"ftkit plan: {exc}"


def start(form: NewRun, roots: Roots) -> Preview:
    """Check as `preview`, then launch its command detached; nothing is written when a check fails."""
    shown = preview(form, roots)
    if not shown.errors:
        launch(roots.runs, form.name, shown.argv, created=True, backend=shown.backend)
    return shown


def launch(root: Path, name: str, argv: list[str], created: bool, backend: str = "") -> int:
    """Run `argv` detached; the record says what was run, in which process group and by whom."""
    record = runs.record_dir(root, name)
    record.mkdir(parents=True, exist_ok=True)
    previous = runs.read_record(root, name)
    pid = launch_waiter(record, argv)
    info = {
        "argv": argv,
        "pid": pid,
        "pgid": pid,
        "created": previous.get("created", created),
        "backend": backend or previous.get("backend", ""),
        "started": time.time(),
    }
    (record / "launch.json").write_text(json.dumps(info) + "\n")
    return pid


def launch_waiter(folder: Path, argv: list[str]) -> int:
    """`argv` under the waiter (toolkit/studio/detach.py) in a session of its own, its output and exit code
    in `folder`; returns the waiter's pid, which is the session's process group."""
    (folder / "exit").unlink(missing_ok=True)
    with (folder / "output.log").open("a") as log:
        log.write(f"$ {shown_command(argv)}\n")
    paths = [str(TOOLKIT_ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths)), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolkit.studio.detach", str(folder), "--", *argv],
        env=env,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc.pid


def resume(root: Path, run_dir: Path) -> None:
    """Relaunch a stopped run: its own command (or, for a run started elsewhere, its saved config), which
    continues from the newest checkpoint (train.resume=auto)."""
    view = runs.summarize(root, run_dir)
    if not view.resumable:
        raise UserError(f"resume: {run_dir.name} is {view.status}, not stopped with a checkpoint")
    record = runs.read_record(root, run_dir.name)
    argv = record.get("argv") or [*FTKIT, "train", "--config", str(run_dir / "config.yaml")]
    argv = [item for item in argv if not item.startswith(("train.resume=", "train.overwrite="))]
    launch(root, run_dir.name, [*argv, "train.resume=auto"], created=False)


def delete(root: Path, run_dir: Path, confirm: str) -> None:
    """Delete a run the studio created, once its name is typed to confirm; never any other folder."""
    from toolkit.checkpoint.rundir import LOCK, clear_output_dir

    record = runs.read_record(root, run_dir.name)
    if not record.get("created"):
        raise UserError(f"delete: {run_dir.name} was not created by the studio; it deletes only its own runs")
    if confirm != run_dir.name:
        raise UserError(f"delete: type the run's name ({run_dir.name}) to confirm")
    if runs.summarize(root, run_dir).status in ("running", "starting"):
        raise UserError(f"delete: {run_dir.name} is running; stop it first")
    if run_dir.is_dir():
        clear_output_dir(run_dir)
        (run_dir / LOCK).unlink(missing_ok=True)
        run_dir.rmdir()
    shutil.rmtree(runs.record_dir(root, run_dir.name))
