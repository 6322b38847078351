"""Evaluate and export: `ftkit eval` and `ftkit export` run as their own command lines, detached under the
same waiter as training, each job's output in RUNS/.studio/RUN/jobs/KIND-TIME/ (its progress is that output;
its last lines say where the files went)."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import UserError
from toolkit.studio import runs
from toolkit.studio.guard import Roots
from toolkit.studio.runner import FTKIT, launch_waiter, shown_command

TASKS = re.compile(r"^[\w.-]+(,[\w.-]+)*$")
PROGRESS_BAR = re.compile(r"\d+%\|.*\|")
GGUF_TYPES = ("f16", "bf16", "q8_0", "q4_k_m", "q5_k_m", "q6_k")


@dataclass
class Job:
    kind: str
    command: str
    status: str
    """running, done, failed (exit N)."""
    output: str
    """The output's last lines, progress-bar redraws folded."""


def gguf_missing() -> str:
    """Why GGUF export is unavailable here ("" when llama.cpp's tools are installed)."""
    from toolkit.gguf.tools import find_tools

    try:
        find_tools(None)
    except UserError as exc:
        return str(exc)
    return ""


def start_eval(roots: Roots, run_dir: Path, tasks: str, limit: str) -> None:
    """`ftkit eval` on the run's final model beside its base (the base column is the run's own base)."""
    tasks = tasks.strip() or "ftkit_sums"
    if not TASKS.match(tasks):
        raise UserError(f"--tasks: {tasks!r} is not a comma-separated list of task names")
    if limit and not (limit.isdigit() and int(limit) > 0):
        raise UserError(f"--limit: {limit!r} is not a positive number of examples")
    final = run_dir / "final"
    if not final.is_dir():
        raise UserError(f"--model: {final} does not exist; the run has not finished")
    argv = [*FTKIT, "eval", "--model", str(final), "--tasks", tasks, *(["--limit", limit] if limit else [])]
    _start(roots.runs, run_dir.name, "eval", argv)


def start_export(roots: Roots, run_dir: Path, kind: str) -> None:
    """`ftkit export` of the newest checkpoint: merged (a full model in RUN-merged) or one GGUF type."""
    checkpoints = runs.checkpoint_names(run_dir)
    if not checkpoints:
        raise UserError(f"export: {run_dir.name} has no checkpoint to export")
    newest = run_dir / "checkpoints" / checkpoints[-1]
    if kind == "merged":
        out = roots.runs / f"{run_dir.name}-merged"
        argv = [*FTKIT, "export", str(newest), "--out", str(out), "--merge-lora"]
    elif kind in GGUF_TYPES:
        missing = gguf_missing()
        if missing:
            raise UserError(missing)
        argv = [
            *FTKIT,
            "export",
            str(run_dir),
            "--gguf",
            kind,
            "--out",
            str(roots.runs / f"{run_dir.name}-gguf"),
        ]
    else:
        raise UserError(f"export: {kind!r} is not merged or one of {', '.join(GGUF_TYPES)}")
    _start(roots.runs, run_dir.name, "export", argv)


def _start(root: Path, name: str, kind: str, argv: list[str]) -> None:
    folder = runs.record_dir(root, name) / "jobs" / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    if folder.exists():
        raise UserError(f"{kind}: one started this second already")
    folder.mkdir(parents=True)
    (folder / "job.json").write_text(json.dumps({"kind": kind, "argv": argv}) + "\n")
    launch_waiter(folder, argv)


def list_jobs(root: Path, name: str) -> list[Job]:
    folder = runs.record_dir(root, name) / "jobs"
    found = []
    for job_dir in sorted(folder.iterdir(), reverse=True) if folder.is_dir() else []:
        try:
            info = json.loads((job_dir / "job.json").read_text())
        except (OSError, ValueError):
            continue
        code = _exit(job_dir)
        status = "running" if code is None else "done" if code == 0 else f"failed (exit {code})"
        found.append(Job(info["kind"], shown_command(info["argv"]), status, _tail(job_dir / "output.log")))
    return found


def _exit(job_dir: Path) -> int | None:
    try:
        return int((job_dir / "exit").read_text())
    except (OSError, ValueError):
        return None


def _tail(path: Path, lines: int = 30) -> str:
    """The output's last lines without its progress bars, but for the newest one (the job's progress)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    folded = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
    bars = [line for line in folded if PROGRESS_BAR.search(line)]
    kept = [line for line in folded if line.strip() and not PROGRESS_BAR.search(line)]
    return "\n".join(kept[-lines:] + bars[-1:])
